//! `sluice-cufile-probe LIB`: the child process of the cuFile probe (`sluice_writer::cufile`).
//! Loads LIB, opens and closes the cuFile driver, prints one line (`available VERSION` or
//! `unavailable: REASON`) and exits 0. Its parent gives it the configuration
//! (`CUFILE_ENV_PATH_JSON`, compat mode off) and kills it if the open does not return in time.

#![forbid(unsafe_code)]

fn main() {
    let lib = std::env::args()
        .nth(1)
        .unwrap_or_else(|| sluice_writer::cufile::LIB.to_string());
    println!("{}", sluice_writer::cufile::child_answer(&lib));
}
