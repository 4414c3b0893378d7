//! End-to-end tests live in `tests/tests/`; this crate only hosts them.
