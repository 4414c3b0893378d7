//! Object-store clients built from the admin's store profiles, each with the site's one retry
//! policy ([`Config::retry`]), and what their errors mean ([`classify`], [`describe`]).
//! Credentials live here, in the agent (root), and are never handed to jobs or written to logs.
//!
//! A profile may also name the storage class of the checkpoint data written to its buckets
//! (`data_class`, [`check_data_class`]): object_store sends it on each data object's PUT or
//! multipart upload as `x-amz-storage-class` (S3), `x-ms-access-tier` (Azure) or
//! `x-goog-storage-class` (GCS).

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

/// S3's storage classes (PutObject's `x-amz-storage-class`).
const S3_CLASSES: &[&str] = &[
    "STANDARD",
    "STANDARD_IA",
    "ONEZONE_IA",
    "INTELLIGENT_TIERING",
    "GLACIER_IR",
    "GLACIER",
    "DEEP_ARCHIVE",
    "REDUCED_REDUNDANCY",
    "EXPRESS_ONEZONE",
    "OUTPOSTS",
    "SNOW",
];
/// Azure Blob's access tiers for block blobs (Put Blob's and Put Block List's `x-ms-access-tier`).
const AZURE_TIERS: &[&str] = &["Hot", "Cool", "Cold", "Archive"];
/// Google Cloud Storage's storage classes.
const GCS_CLASSES: &[&str] = &["STANDARD", "NEARLINE", "COLDLINE", "ARCHIVE"];

/// Checks a store profile's `data_class` against the classes the store of its `prefix` (`s3://`,
/// `az://`, `gs://`) knows, ignoring case, and returns it spelled as the store spells it
/// (`standard_ia` → `STANDARD_IA`, `cool` → `Cool`). The error names the profile and the key.
pub fn check_data_class(prefix: &str, class: &str) -> Result<String, String> {
    let scheme = prefix.split_once("://").map_or("", |(s, _)| s);
    let (store, known) = match scheme {
        "s3" => ("an S3 storage class", S3_CLASSES),
        "az" | "azure" | "abfs" => ("an Azure access tier", AZURE_TIERS),
        "gs" => ("a GCS storage class", GCS_CLASSES),
        _ => {
            return Err(format!(
                "[[store]] prefix '{prefix}': data_class applies to object stores only (s3://, az://, gs://)"
            ));
        }
    };
    known
        .iter()
        .find(|k| k.eq_ignore_ascii_case(class))
        .map(|k| k.to_string())
        .ok_or_else(|| {
            format!(
                "[[store]] prefix '{prefix}': data_class '{class}' is not {store}; use one of {}",
                known.join(", ")
            )
        })
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

    #[test]
    fn data_classes_are_checked_for_the_profiles_store_and_spelled_as_it_spells_them() {
        let ok = |prefix, class| check_data_class(prefix, class).unwrap();
        assert_eq!(ok("s3://", "STANDARD_IA"), "STANDARD_IA");
        assert_eq!(ok("s3://ckpt", "glacier_ir"), "GLACIER_IR");
        assert_eq!(ok("az://", "cool"), "Cool");
        assert_eq!(ok("azure://ckpt", "ARCHIVE"), "Archive");
        assert_eq!(ok("gs://b", "Nearline"), "NEARLINE");
        let bad = |prefix, class| check_data_class(prefix, class).unwrap_err();
        let e = bad("s3://", "Cool");
        assert!(
            e.contains("[[store]] prefix 's3://': data_class 'Cool' is not an S3 storage class")
                && e.contains("STANDARD_IA, ONEZONE_IA"),
            "{e}"
        );
        let e = bad("az://", "STANDARD_IA");
        assert!(
            e.contains("data_class 'STANDARD_IA' is not an Azure access tier; use one of Hot, Cool, Cold, Archive"),
            "{e}"
        );
        let e = bad("gs://", "GLACIER");
        assert!(e.contains("not a GCS storage class"), "{e}");
        let e = bad("file:///lustre", "Cool");
        assert!(
            e.contains("data_class applies to object stores only"),
            "{e}"
        );
        assert!(is_offline_class("GLACIER") && is_offline_class("Archive"));
        assert!(!is_offline_class("GLACIER_IR") && !is_offline_class("ARCHIVE"));
    }
}
