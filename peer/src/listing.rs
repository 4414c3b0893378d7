//! A dataset's listing, passed from the one node of a job that lists the origin to the job's
//! other nodes, so that the origin sees one listing pass per job rather than one per node.
//!
//! The peer layer carries pages of bytes; what a page holds (the objects, their sizes and
//! versions) is the stager's (`sluice_stage::peers::listing`). A page is asked for by the
//! dataset's name in the job, the source URL the asking node stages it from (a node that stages
//! that name from another source answers `409 not owner`), and the index of its first object:
//!
//! ```text
//! GET /v1/jobs/{job}/listing?dataset={name}&source={url}&from={n}
//!
//! 200  the page (at most MAX_PAGE bytes), x-sluice-blake3 of it, MAC'd over the unit
//!      ("\0listing/{name}", from, its length) like a unit's answer
//! 503  pending (the lister has not listed that far within the poll window)   409 not the lister
//! 502  the lister's listing failed   410 the job ended here   (MAC'd over the same unit, length 0)
//! ```
//!
//! Admission is every job resource's: an agent of the job, by the job key's MAC. Waiting for a page
//! adds an edge to the job's wait graph only toward the lister, which waits on nobody for it.

use crate::Unit;
use crate::server::{query_fields, query_number, query_text};

/// The longest page a lister sends and a node takes (a page of an S3 listing holds 1,000 keys of
/// at most 1,024 bytes each, plus sizes and versions).
pub const MAX_PAGE: u64 = 16 << 20;

/// One page of one dataset's listing, as a request names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageRequest {
    /// The dataset's name in the job.
    pub dataset: String,
    /// The URL the asking node stages it from.
    pub source: String,
    /// The index of the page's first object in the listing.
    pub from: u64,
}

impl PageRequest {
    /// `dataset=..&source=..&from=..`: each exactly once, nothing else.
    pub(crate) fn parse(query: &str) -> Result<PageRequest, String> {
        let fields = query_fields(query, &["dataset", "source", "from"])?;
        Ok(PageRequest {
            dataset: query_text(&fields, "dataset")?.to_string(),
            source: query_text(&fields, "source")?.to_string(),
            from: query_number(&fields, "from")?,
        })
    }

    /// The query that names this page, percent-encoded.
    pub(crate) fn query(&self) -> String {
        url::form_urlencoded::Serializer::new(String::new())
            .append_pair("dataset", &self.dataset)
            .append_pair("source", &self.source)
            .append_pair("from", &self.from.to_string())
            .finish()
    }

    /// What an answer about this page is MAC'd over: a unit no dataset has (its file starts with a
    /// NUL), `len` the page's length in a data answer and 0 in any other.
    pub(crate) fn unit(&self, len: u64) -> Unit {
        Unit::new(format!("\0listing/{}", self.dataset), self.from, len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_queries_round_trip_any_name_and_url() {
        let asked = PageRequest {
            dataset: "a b&c=d".into(),
            source: "s3://bucket/pre fix?x=1".into(),
            from: 7,
        };
        assert_eq!(PageRequest::parse(&asked.query()).unwrap(), asked);
        for bad in [
            "dataset=a&source=s3://b",
            "dataset=a&source=s3://b&from=x",
            "dataset=&source=s3://b&from=1",
            "dataset=a&source=s3://b&from=1&from=2",
            "dataset=a&source=s3://b&from=1&file=x",
        ] {
            assert!(PageRequest::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_page_is_signed_as_no_unit_of_any_dataset() {
        let asked = PageRequest {
            dataset: "ds".into(),
            source: "s3://b/ds".into(),
            from: 2,
        };
        let unit = asked.unit(10);
        assert!(unit.file.starts_with('\0'));
        assert_eq!((unit.offset, unit.len), (2, 10));
    }
}
