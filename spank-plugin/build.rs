//! Generates the raw SPANK bindings from the installed Slurm headers and reads the Slurm version the
//! plugin must announce.
//!
//! A SPANK plugin is only loaded by a Slurm whose major.minor equals the plugin's `plugin_version`, so
//! the version comes from the very headers the bindings are generated from. Point `SLURM_INCLUDE_DIR`
//! at another installation's include directory (the one holding `slurm/spank.h`) to build for it.

use std::env;
use std::fs;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-env-changed=SLURM_INCLUDE_DIR");
    let include_dir =
        PathBuf::from(env::var("SLURM_INCLUDE_DIR").unwrap_or_else(|_| "/usr/include".to_string()));
    let spank_h = include_dir.join("slurm/spank.h");
    let version_h = include_dir.join("slurm/slurm_version.h");
    for header in [&spank_h, &version_h] {
        if !header.exists() {
            panic!(
                "{} not found: install Slurm's development headers (Debian: libslurm-dev) or set SLURM_INCLUDE_DIR \
                 to the directory that holds slurm/spank.h",
                header.display()
            );
        }
        println!("cargo:rerun-if-changed={}", header.display());
    }

    // Slurm 25.05 lets a plugin choose what a failing slurm_spank_init fails: the node (drained, the
    // default) or only the job (`int slurm_spank_init_failure_mode = ESPANK_JOB_FAILURE;`). The
    // constant is in slurm_errno.h from that release on; entry.rs exports the symbol only then.
    println!("cargo::rustc-check-cfg=cfg(spank_init_failure_mode)");
    let errno_h = include_dir.join("slurm/slurm_errno.h");
    println!("cargo:rerun-if-changed={}", errno_h.display());
    let errno_text = fs::read_to_string(&errno_h).unwrap_or_default();
    if errno_text.contains("ESPANK_JOB_FAILURE") {
        println!("cargo:rustc-cfg=spank_init_failure_mode");
    }

    let version_text = fs::read_to_string(&version_h).expect("read slurm_version.h");
    let version = slurm_version_number(&version_text).unwrap_or_else(|| {
        panic!(
            "no '#define SLURM_VERSION_NUMBER' in {}",
            version_h.display()
        )
    });
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR"));
    fs::write(
        out_dir.join("slurm_version.rs"),
        format!("/// `SLURM_VERSION_NUMBER` of {}.\npub const SLURM_VERSION_NUMBER: u32 = {version:#x};\n", version_h.display()),
    )
    .expect("write slurm_version.rs");

    let bindings = bindgen::Builder::default()
        .header(spank_h.to_string_lossy())
        .clang_arg(format!("-I{}", include_dir.display()))
        .allowlist_type("spank_.*")
        .allowlist_type("spank_t")
        .allowlist_function("spank_.*")
        // slurm_spank_log, and the entry points spank.h declares (`extern spank_f slurm_spank_init;`):
        // entry.rs checks each one the plugin defines against them, name and type.
        .allowlist_function("slurm_spank_.*")
        .allowlist_function("slurm_(error|info|verbose|debug)")
        .allowlist_var("ESPANK_.*")
        .allowlist_var("SPANK_OPTION_MAXLEN")
        // spank_item, spank_context and slurm_err_t as plain integer constants: values that Slurm
        // hands back are then never an invalid Rust enum.
        .default_enum_style(bindgen::EnumVariation::Consts)
        .prepend_enum_name(false)
        .layout_tests(false)
        .generate_comments(false)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()))
        .generate()
        .expect("generate SPANK bindings with bindgen (needs libclang)");
    bindings
        .write_to_file(out_dir.join("spank_sys.rs"))
        .expect("write SPANK bindings");
}

/// Parses `#define SLURM_VERSION_NUMBER 0x160508` (hex or decimal).
fn slurm_version_number(header: &str) -> Option<u32> {
    header.lines().find_map(|line| {
        let mut words = line.split_whitespace();
        if words.next()? != "#define" || words.next()? != "SLURM_VERSION_NUMBER" {
            return None;
        }
        let value = words.next()?;
        match value
            .strip_prefix("0x")
            .or_else(|| value.strip_prefix("0X"))
        {
            Some(hex) => u32::from_str_radix(hex, 16).ok(),
            None => value.parse().ok(),
        }
    })
}
