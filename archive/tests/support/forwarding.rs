//! What the test stores that wrap a real `ObjectStore` have in common: they watch writes and pass
//! everything else through. object_store's traits are declared with `async_trait`; their expansion
//! is spelled out here so the tests need no extra dependency.
//!
//! Shared by the conformance suite (`archive/tests/archive_conformance.rs`) and the engine's resume
//! tests (`archive/src/tests/resume.rs`, which include this file by path).

/// The boxed future an expanded `async_trait` method returns.
pub type Fut<'a, T> =
    std::pin::Pin<Box<dyn std::future::Future<Output = object_store::Result<T>> + Send + 'a>>;

/// Completes `inner`, then calls `done` if it completed: a wrapper's `MultipartUpload::complete`
/// that notes what the store stored.
pub fn complete_then<'a>(
    inner: &'a mut Box<dyn object_store::MultipartUpload>,
    done: impl FnOnce() + Send + 'a,
) -> Fut<'a, object_store::PutResult> {
    Box::pin(async move {
        let r = inner.complete().await;
        if r.is_ok() {
            done();
        }
        r
    })
}

/// The `ObjectStore` methods a wrapper passes to its `inner` store unchanged: reads, listings,
/// deletes and copies. Inside `impl ObjectStore for Wrapper { … }`.
macro_rules! forward_to_inner {
    () => {
        fn get_opts<'l0, 'l1, 'a>(
            &'l0 self,
            location: &'l1 object_store::path::Path,
            options: object_store::GetOptions,
        ) -> Fut<'a, object_store::GetResult>
        where
            'l0: 'a,
            'l1: 'a,
            Self: 'a,
        {
            self.inner.get_opts(location, options)
        }

        fn delete_stream(
            &self,
            locations: futures::stream::BoxStream<
                'static,
                object_store::Result<object_store::path::Path>,
            >,
        ) -> futures::stream::BoxStream<'static, object_store::Result<object_store::path::Path>> {
            self.inner.delete_stream(locations)
        }

        fn list(
            &self,
            prefix: Option<&object_store::path::Path>,
        ) -> futures::stream::BoxStream<'static, object_store::Result<object_store::ObjectMeta>> {
            self.inner.list(prefix)
        }

        fn list_with_delimiter<'l0, 'l1, 'a>(
            &'l0 self,
            prefix: Option<&'l1 object_store::path::Path>,
        ) -> Fut<'a, object_store::ListResult>
        where
            'l0: 'a,
            'l1: 'a,
            Self: 'a,
        {
            self.inner.list_with_delimiter(prefix)
        }

        fn copy_opts<'l0, 'l1, 'l2, 'a>(
            &'l0 self,
            from: &'l1 object_store::path::Path,
            to: &'l2 object_store::path::Path,
            options: object_store::CopyOptions,
        ) -> Fut<'a, ()>
        where
            'l0: 'a,
            'l1: 'a,
            'l2: 'a,
            Self: 'a,
        {
            self.inner.copy_opts(from, to, options)
        }
    };
}
