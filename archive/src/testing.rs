//! Test helpers for the archive's own tests and the dev-dependencies of the crates above (feature
//! `testing`): [`Watched`], a store that passes every request to a real one and shows the writes to
//! a [`Watch`] — the engine's resume tests count the data objects an upload stored, the conformance
//! suite checks the order of the writes each backend saw, and both inject failures.

use futures::stream::BoxStream;
use object_store::path::Path;
use object_store::{
    Attributes, CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta,
    ObjectStore, PutMultipartOptions, PutOptions, PutPayload, PutResult, UploadPart,
};
use std::sync::Arc;

/// A write the store was asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request {
    /// A single PUT.
    Put,
    /// The start of a multipart upload.
    Multipart,
}

/// A write that finished, by the key it wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Write {
    /// A single PUT returned.
    Put(String),
    /// A multipart upload completed.
    Multipart(String),
    /// A multipart upload was aborted (whether or not the abort succeeded).
    Aborted(String),
}

/// What a [`Watched`] store tells about its writes, and where it lets a test fail one. Reads,
/// listings, deletes and copies pass by unseen.
pub trait Watch: std::fmt::Debug + Send + Sync + 'static {
    /// Before a write of `location` with these attributes goes to the store: an error fails it.
    fn before(
        &self,
        _location: &Path,
        _request: Request,
        _attributes: &Attributes,
    ) -> object_store::Result<()> {
        Ok(())
    }

    /// Before part `n` (counted from 1) of the multipart upload to `location` goes to the store:
    /// an error fails the part.
    fn before_part(&self, _location: &Path, _n: usize) -> object_store::Result<()> {
        Ok(())
    }

    /// What the store is given of a PUT's or a part's payload: as is, unless the watch says so.
    fn payload(&self, payload: PutPayload) -> PutPayload {
        payload
    }

    /// A write finished: a PUT returned `Ok`, a multipart upload completed, or one was aborted.
    fn wrote(&self, write: Write);
}

/// A store that forwards to `inner`, showing its writes to `watch`.
#[derive(Debug)]
pub struct Watched<W, S = Arc<dyn ObjectStore>> {
    pub inner: S,
    pub watch: Arc<W>,
}

impl<W: Watch, S: ObjectStore> Watched<W, S> {
    pub fn new(inner: S, watch: W) -> Watched<W, S> {
        Watched {
            inner,
            watch: Arc::new(watch),
        }
    }
}

impl<W, S: std::fmt::Display> std::fmt::Display for Watched<W, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Watched({})", self.inner)
    }
}

#[async_trait::async_trait]
impl<W: Watch, S: ObjectStore> ObjectStore for Watched<W, S> {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        self.watch
            .before(location, Request::Put, &opts.attributes)?;
        let payload = self.watch.payload(payload);
        let r = self.inner.put_opts(location, payload, opts).await;
        if r.is_ok() {
            self.watch.wrote(Write::Put(location.to_string()));
        }
        r
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.watch
            .before(location, Request::Multipart, &opts.attributes)?;
        let inner = self.inner.put_multipart_opts(location, opts).await?;
        Ok(Box::new(WatchedUpload {
            inner,
            location: location.clone(),
            watch: self.watch.clone(),
            parts: 0,
        }))
    }

    async fn get_opts(
        &self,
        location: &Path,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        self.inner.get_opts(location, options).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<Path>>,
    ) -> BoxStream<'static, object_store::Result<Path>> {
        self.inner.delete_stream(locations)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> object_store::Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &Path,
        to: &Path,
        options: CopyOptions,
    ) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }
}

/// A multipart upload of a [`Watched`] store.
#[derive(Debug)]
struct WatchedUpload<W> {
    inner: Box<dyn MultipartUpload>,
    location: Path,
    watch: Arc<W>,
    /// Parts put so far.
    parts: usize,
}

#[async_trait::async_trait]
impl<W: Watch> MultipartUpload for WatchedUpload<W> {
    fn put_part(&mut self, data: PutPayload) -> UploadPart {
        self.parts += 1;
        if let Err(e) = self.watch.before_part(&self.location, self.parts) {
            return Box::pin(async { Err(e) });
        }
        self.inner.put_part(self.watch.payload(data))
    }

    async fn complete(&mut self) -> object_store::Result<PutResult> {
        let r = self.inner.complete().await;
        if r.is_ok() {
            self.watch
                .wrote(Write::Multipart(self.location.to_string()));
        }
        r
    }

    async fn abort(&mut self) -> object_store::Result<()> {
        let r = self.inner.abort().await;
        self.watch.wrote(Write::Aborted(self.location.to_string()));
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use object_store::ObjectStoreExt;
    use object_store::memory::InMemory;
    use std::sync::Mutex;

    /// Notes every write; fails PUTs of `refused` and every part after the first.
    #[derive(Debug, Default)]
    struct Log(Mutex<Vec<Write>>);

    fn refused() -> object_store::Error {
        object_store::Error::Generic {
            store: "Log",
            source: "refused".into(),
        }
    }

    impl Watch for Log {
        fn before(
            &self,
            location: &Path,
            request: Request,
            _: &Attributes,
        ) -> object_store::Result<()> {
            if request == Request::Put && location.as_ref() == "refused" {
                return Err(refused());
            }
            Ok(())
        }

        fn before_part(&self, _: &Path, n: usize) -> object_store::Result<()> {
            match n {
                1 => Ok(()),
                _ => Err(refused()),
            }
        }

        fn wrote(&self, write: Write) {
            self.0.lock().unwrap().push(write);
        }
    }

    #[tokio::test]
    async fn a_watch_sees_the_writes_that_finished_and_fails_the_ones_it_refuses() {
        let store = Watched::new(InMemory::new(), Log::default());
        store.put(&"a".into(), b"1".to_vec().into()).await.unwrap();
        assert!(
            store
                .put(&"refused".into(), b"1".to_vec().into())
                .await
                .is_err()
        );
        let mut up = store.put_multipart(&"m".into()).await.unwrap();
        up.put_part(b"1".to_vec().into()).await.unwrap();
        up.complete().await.unwrap();
        let mut up = store.put_multipart(&"n".into()).await.unwrap();
        up.put_part(b"1".to_vec().into()).await.unwrap();
        assert!(up.put_part(b"2".to_vec().into()).await.is_err());
        up.abort().await.unwrap();
        assert_eq!(
            *store.watch.0.lock().unwrap(),
            [
                Write::Put("a".into()),
                Write::Multipart("m".into()),
                Write::Aborted("n".into())
            ]
        );
        // Reads pass through to the inner store.
        assert_eq!(
            store.get(&"m".into()).await.unwrap().bytes().await.unwrap(),
            "1"
        );
        assert!(store.inner.head(&"refused".into()).await.is_err());
    }
}
