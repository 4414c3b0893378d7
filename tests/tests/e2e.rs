//! The end-to-end suite: one test binary, one module per concern (the files beside this one), and
//! the fixtures every module shares (`common`, and `security_support` for the security modules).
//! Every test here needs the test cluster (`tests/harness/run-e2e.sh` brings it up) and is
//! `#[ignore]`d with that reason otherwise; `run-e2e.sh NAME` runs the tests whose path contains NAME
//! (a module, e.g. `stage_in`, or one test).
//!
//! One binary rather than one per file: `common` compiles once, and a fixture no module uses is dead
//! code the compiler reports.

mod common;
mod security_support;

mod aggregation;
mod archive_tiering;
mod cache;
mod ckpt;
mod cleanup;
mod doctor;
mod failures;
mod faults_crash;
mod faults_crash_archive;
mod faults_hot_tier;
mod faults_store;
mod frameworks;
mod hostile_keys;
mod metrics;
mod plain_jobs;
mod poison;
mod ram_tier;
mod replicas;
mod requeue;
mod resume;
mod scale;
mod security_auth;
mod security_ckpt;
mod security_frames;
mod security_jobdir;
mod security_options;
mod stage_in;
mod step_staging;
mod submit_validation;
mod user_archive;
mod version_skew;
mod writer;
