//! Object-store clients built from the admin's store profiles, each with the site's one retry
//! policy ([`Config::retry`]), and what their errors mean ([`classify`], [`describe`]).
//! Credentials live here, in the agent (root), and are never handed to jobs or written to logs.

use crate::config::{Config, StoreProfile};
use object_store::ObjectStore;
use object_store::aws::AmazonS3Builder;
use object_store::azure::MicrosoftAzureBuilder;
use object_store::gcp::GoogleCloudStorageBuilder;
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
    let retry = cfg.retry.clone();
    Ok(match scheme {
        ObjectScheme::S3 => Arc::new(s3(profile, bucket).with_retry(retry).build()?),
        ObjectScheme::Azure => Arc::new(azure(profile, bucket).with_retry(retry).build()?),
        ObjectScheme::Gcs => {
            let mut b = GoogleCloudStorageBuilder::from_env()
                .with_bucket_name(bucket)
                .with_retry(retry);
            if let Some(p) = profile.and_then(|p| p.service_account_path.as_ref()) {
                b = b.with_service_account_path(p);
            }
            Arc::new(b.build()?)
        }
    })
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
