//! Object-store clients built from the admin's store profiles, each with the site's one retry
//! policy ([`Config::retry`], as object_store's [`RetryConfig`]: [`retry_config`]), and what their
//! errors mean ([`classify`], [`describe`]).
//! Credentials live here, in the agent (root), and are never handed to jobs or written to logs.
//!
//! A profile may also name the storage class of the checkpoint data written to its buckets
//! (`data_class`, checked by [`sluice_core::config::check_data_class`]): object_store sends it on each data object's PUT or
//! multipart upload as `x-amz-storage-class` (S3), `x-ms-access-tier` (Azure) or
//! `x-goog-storage-class` (GCS).

use object_store::aws::AmazonS3Builder;
use object_store::azure::MicrosoftAzureBuilder;
use object_store::gcp::GoogleCloudStorageBuilder;
use object_store::{BackoffConfig, ObjectStore, RetryConfig};
use sluice_core::config::{Config, RetryPolicy, StoreProfile};
use sluice_proto::options::ObjectScheme;
use std::sync::Arc;

mod error;

pub use error::{StoreErrorKind, classify, describe};

/// Builds a client for `scheme://bucket`, using the profile with the longest matching prefix. Without
/// a profile, the provider's usual environment (instance credentials, ...) is used.
pub fn open(
    cfg: &Config,
    scheme: ObjectScheme,
    bucket: &str,
) -> object_store::Result<Arc<dyn ObjectStore>> {
    let url = format!("{}://{bucket}/", scheme.url_scheme());
    let profile = cfg.store_for(&url);
    let retry = retry_config(&cfg.retry);
    let built: object_store::Result<Arc<dyn ObjectStore>> = match scheme {
        ObjectScheme::S3 => s3(profile, bucket)
            .with_retry(retry)
            .build()
            .map(|s| Arc::new(s) as _),
        ObjectScheme::Azure => azure(profile, bucket)
            .with_retry(retry)
            .build()
            .map(|s| Arc::new(s) as _),
        ObjectScheme::Gcs => {
            let mut b = GoogleCloudStorageBuilder::from_env()
                .with_bucket_name(bucket)
                .with_retry(retry);
            if let Some(p) = profile.and_then(|p| p.service_account_path.as_ref()) {
                b = b.with_service_account_path(p);
            }
            b.build().map(|s| Arc::new(s) as _)
        }
    };
    built.map_err(without_ca_certificates)
}

/// The HTTP client loads the system's CA certificates when it is built, for http:// endpoints
/// too, and fails without any with only "Generic HTTP client error: builder error" on top: a node
/// image without them (a minimal container, a fresh chroot) gets that for every store. Says what is
/// missing and what to install instead.
fn without_ca_certificates(e: object_store::Error) -> object_store::Error {
    let mut source: Option<&dyn std::error::Error> = Some(&e);
    while let Some(s) = source {
        if s.to_string().contains("No CA certificates") {
            return object_store::Error::Generic {
                store: "HTTP client",
                source: "this node has no CA certificates (the store client reads the system's, \
                         even for http:// endpoints): install them (Debian: apt-get install \
                         ca-certificates)"
                    .into(),
            };
        }
        source = s.source();
    }
    e
}

/// The site's `[retry]` policy in object_store's terms: exponential backoff with object_store's base
/// (2) and jitter.
pub fn retry_config(p: &RetryPolicy) -> RetryConfig {
    RetryConfig {
        max_retries: p.max_retries,
        retry_timeout: p.timeout,
        backoff: BackoffConfig {
            init_backoff: p.initial_backoff,
            max_backoff: p.max_backoff,
            ..BackoffConfig::default()
        },
    }
}

fn s3(profile: Option<&StoreProfile>, bucket: &str) -> AmazonS3Builder {
    let Some(p) = profile else {
        return AmazonS3Builder::from_env().with_bucket_name(bucket);
    };
    let mut b = AmazonS3Builder::new()
        .with_bucket_name(bucket)
        .with_allow_http(p.allow_http);
    if let Some(v) = &p.endpoint {
        b = b.with_endpoint(v);
    }
    if let Some(v) = &p.region {
        b = b.with_region(v);
    }
    if let Some(v) = &p.access_key_id {
        b = b.with_access_key_id(v);
    }
    if let Some(v) = &p.secret_access_key {
        b = b.with_secret_access_key(v);
    }
    b
}

fn azure(profile: Option<&StoreProfile>, container: &str) -> MicrosoftAzureBuilder {
    let Some(p) = profile else {
        return MicrosoftAzureBuilder::from_env().with_container_name(container);
    };
    let mut b = MicrosoftAzureBuilder::new()
        .with_container_name(container)
        .with_use_emulator(p.use_emulator)
        .with_allow_http(p.allow_http || p.use_emulator);
    if let Some(v) = &p.endpoint {
        b = b.with_endpoint(v.clone());
    }
    if let Some(v) = &p.account {
        b = b.with_account(v);
    }
    if let Some(v) = &p.access_key {
        b = b.with_access_key(v);
    }
    b
}

/// The storage class checkpoint data written to `scheme://bucket` gets: the `data_class` of the
/// profile [`open`] takes the bucket's endpoint and credentials from; `None` = the store's
/// default.
pub fn data_class(cfg: &Config, scheme: ObjectScheme, bucket: &str) -> Option<String> {
    let url = format!("{}://{bucket}/", scheme.url_scheme());
    cfg.store_for(&url).and_then(|p| p.data_class.clone())
}

/// Classes whose objects cannot be read until they are restored (S3 `GLACIER`, `DEEP_ARCHIVE`) or
/// rehydrated (Azure `Archive`) in the store: sluice can list such a checkpoint (its MANIFEST
/// stays in the default class) but restores and verifies it only once its data is back online.
pub fn is_offline_class(class: &str) -> bool {
    matches!(class, "GLACIER" | "DEEP_ARCHIVE" | "Archive")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An unset `[retry]` key keeps object_store's default: sluice-core spells the defaults out
    /// (it does not link object_store), and this holds them to object_store's own.
    #[test]
    fn the_default_retry_policy_is_object_stores() {
        let (ours, theirs) = (
            retry_config(&RetryPolicy::default()),
            RetryConfig::default(),
        );
        assert_eq!(
            (ours.max_retries, ours.retry_timeout),
            (theirs.max_retries, theirs.retry_timeout)
        );
        let (ours, theirs) = (ours.backoff, theirs.backoff);
        assert_eq!(
            (ours.init_backoff, ours.max_backoff, ours.base),
            (theirs.init_backoff, theirs.max_backoff, theirs.base)
        );
    }

    #[test]
    fn glacier_and_azure_archive_are_offline_classes() {
        assert!(is_offline_class("GLACIER") && is_offline_class("Archive"));
        assert!(!is_offline_class("GLACIER_IR") && !is_offline_class("ARCHIVE"));
    }
}
