//! What `sluice doctor` reads from Slurm: its configuration (`scontrol show config`, else
//! slurm.conf), the `plugstack.conf` lines that load the plugin, the plugin's `plugin_version`
//! symbol (read from the ELF file, never by loading it: loading runs its constructors and needs
//! Slurm's own symbols), and the running Slurm's version. Parsing and judging are pure functions
//! of text and bytes, tested here; the doctor module does the I/O.

use super::{Finding, Status};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The plugin's file name as installed (`libspank_sluice.so` as cargo builds it).
const PLUGIN_NAMES: &[&str] = &["spank_sluice.so", "libspank_sluice.so"];
/// The line to add, as slurm-conf/plugstack.conf has it.
pub const PLUGSTACK_LINE: &str =
    "required /usr/local/lib/sluice/spank_sluice.so socket=/run/sluice/%n.sock";

/// Slurm's settings, keys lower-cased, and where they were read.
#[derive(Debug, Clone, Default)]
pub struct SlurmConf {
    pub source: String,
    pub values: BTreeMap<String, String>,
}

impl SlurmConf {
    pub fn get(&self, key: &str) -> Option<&str> {
        self.values
            .get(&key.to_ascii_lowercase())
            .map(String::as_str)
            .filter(|v| !v.is_empty() && *v != "(null)")
    }
}

/// `scontrol show config`: `Key                     = Value` lines.
pub fn parse_show_config(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.split_once(" = "))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .filter(|(k, _)| !k.is_empty() && !k.contains(' '))
        .collect()
}

/// slurm.conf: `Key=Value` lines, `#` comments; only the first pair of a line (NodeName= and
/// PartitionName= lines hold several, none of which the doctor reads).
pub fn parse_slurm_conf(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .map(|l| l.split('#').next().unwrap_or_default().trim())
        .filter_map(|l| l.split_whitespace().next()?.split_once('='))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect()
}

/// One meaningful line of a plugstack file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlugLine {
    Plugin {
        required: bool,
        path: String,
        line: usize,
    },
    Include {
        pattern: String,
    },
}

/// spank(8)'s syntax: `required|optional PATH [ARGS]`, `include GLOB`, `#` to the end of a line.
/// Lines Slurm would reject are left out (Slurm itself fails to start on them).
pub fn parse_plugstack(text: &str) -> Vec<PlugLine> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or_default();
        let mut words = line.split_whitespace();
        let (Some(kind), Some(arg)) = (words.next(), words.next()) else {
            continue;
        };
        match kind {
            "required" | "optional" => out.push(PlugLine::Plugin {
                required: kind == "required",
                path: arg.to_string(),
                line: i + 1,
            }),
            "include" => out.push(PlugLine::Include {
                pattern: arg.to_string(),
            }),
            _ => {}
        }
    }
    out
}

/// `*` and `?` in one file name (plugstack includes glob file names within a directory).
pub fn glob_match(pattern: &str, name: &str) -> bool {
    fn go(p: &[char], n: &[char]) -> bool {
        match (p.first(), n.first()) {
            (None, None) => true,
            (Some('*'), _) => go(&p[1..], n) || (!n.is_empty() && go(p, &n[1..])),
            (Some('?'), Some(_)) => go(&p[1..], &n[1..]),
            (Some(a), Some(b)) => a == b && go(&p[1..], &n[1..]),
            _ => false,
        }
    }
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    go(&p, &n)
}

/// A line that loads sluice's plugin, found in `file`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginLine {
    pub file: PathBuf,
    pub line: usize,
    pub required: bool,
    pub so: PathBuf,
}

/// The plugin's lines among the parsed files; relative plugin paths are Slurm's `PluginDir`'s.
pub fn sluice_lines(
    files: &[(PathBuf, Vec<PlugLine>)],
    plugin_dir: Option<&str>,
) -> Vec<PluginLine> {
    let mut out = Vec::new();
    for (file, lines) in files {
        for l in lines {
            let PlugLine::Plugin {
                required,
                path,
                line,
            } = l
            else {
                continue;
            };
            let p = Path::new(path);
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            if !PLUGIN_NAMES.contains(&name) {
                continue;
            }
            let so = match plugin_dir {
                Some(dir) if p.is_relative() => {
                    Path::new(dir.split(':').next().unwrap_or(dir)).join(p)
                }
                _ => p.to_path_buf(),
            };
            out.push(PluginLine {
                file: file.clone(),
                line: *line,
                required: *required,
                so,
            });
        }
    }
    out
}

/// The plugstack check: the plugin is loaded once, `required`, from a file that exists.
pub fn judge_plugstack(
    main: &Path,
    main_read: Result<(), String>,
    files: &[PathBuf],
    lines: &[PluginLine],
    exists: impl Fn(&Path) -> bool,
) -> Finding {
    let check = "plugstack";
    if let Err(e) = main_read {
        return Finding::new(
            check,
            Status::Fail,
            format!("cannot read {}: {e}", main.display()),
            Some(format!(
                "create {} with the line `{PLUGSTACK_LINE}` (slurm-conf/plugstack.conf), or set PlugStackConfig in slurm.conf",
                main.display()
            )),
        );
    }
    let read: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
    let Some(first) = lines.first() else {
        return Finding::new(
            check,
            Status::Fail,
            format!("no line loads spank_sluice.so in {}", read.join(", ")),
            Some(format!(
                "add `{PLUGSTACK_LINE}` to {} (slurm-conf/plugstack.conf), then restart slurmd",
                main.display()
            )),
        );
    };
    let at = format!("{}:{}", first.file.display(), first.line);
    if !exists(&first.so) {
        return Finding::new(
            check,
            Status::Fail,
            format!("{at} loads {}, which does not exist", first.so.display()),
            Some(format!(
                "install the plugin: install -D -m 0755 target/release/libspank_sluice.so {}",
                first.so.display()
            )),
        );
    }
    if lines.len() > 1 {
        let all: Vec<String> = lines
            .iter()
            .map(|l| format!("{}:{}", l.file.display(), l.line))
            .collect();
        return Finding::new(
            check,
            Status::Warn,
            format!(
                "the plugin is loaded by {} lines: {}",
                lines.len(),
                all.join(", ")
            ),
            Some("keep one line (Slurm loads the plugin once per line)".into()),
        );
    }
    if !first.required {
        return Finding::new(
            check,
            Status::Warn,
            format!(
                "{at} loads {} as optional: Slurm ignores an optional plugin's errors, so a failed stage-in does not stop the job and its script runs without its data",
                first.so.display()
            ),
            Some(format!(
                "change `optional` to `required` at {at} (the plugin fails only in task_init, which fails the job without draining the node)"
            )),
        );
    }
    Finding::new(
        check,
        Status::Pass,
        format!("{at}: required {}", first.so.display()),
        None,
    )
}

/// `plugin_version` from the plugin's ELF file: the dynamic symbol's 4 bytes in its section.
pub fn plugin_version(elf: &[u8]) -> Result<u32, String> {
    use object::{Object, ObjectSection, ObjectSymbol};
    let file = object::File::parse(elf).map_err(|e| format!("not an ELF object: {e}"))?;
    let sym = file
        .dynamic_symbols()
        .chain(file.symbols())
        .find(|s| s.name() == Ok("plugin_version"))
        .ok_or("it exports no plugin_version symbol")?;
    let index = sym
        .section_index()
        .ok_or("its plugin_version symbol is not defined in the file")?;
    let section = file
        .section_by_index(index)
        .map_err(|e| format!("plugin_version's section: {e}"))?;
    let bytes = section
        .data_range(sym.address(), 4)
        .map_err(|e| format!("plugin_version's bytes: {e}"))?
        .ok_or("plugin_version's bytes are not in the file")?;
    let bytes: [u8; 4] = bytes
        .try_into()
        .map_err(|_| "plugin_version is not 4 bytes")?;
    Ok(if file.is_little_endian() {
        u32::from_le_bytes(bytes)
    } else {
        u32::from_be_bytes(bytes)
    })
}

/// `scontrol --version` (`slurm 23.11.4`, `slurm-wlm 22.05.8`) as `SLURM_VERSION_NUMBER`.
pub fn parse_slurm_version(text: &str) -> Option<u32> {
    let v = text.split_whitespace().last()?;
    let mut parts = v.split('.').map(|p| {
        let digits: String = p.chars().take_while(char::is_ascii_digit).collect();
        digits.parse::<u32>().ok()
    });
    let (major, minor, micro) = (parts.next()??, parts.next()??, parts.next().flatten()?);
    (minor <= 0xff && micro <= 0xff).then_some(major << 16 | minor << 8 | micro)
}

/// `22.05.8`, from a `SLURM_VERSION_NUMBER`.
pub fn version_text(v: u32) -> String {
    format!("{}.{:02}.{}", v >> 16, (v >> 8) & 0xff, v & 0xff)
}

/// Slurm loads a plugin whose major.minor release is its own; another micro version loads but was
/// built against other headers.
pub fn judge_plugin_version(
    so: Option<&Path>,
    plugin: Result<u32, String>,
    slurm: Result<u32, String>,
) -> Finding {
    let check = "plugin version";
    // Every finding but a pass says what to do.
    let finding = |status, detail: String, fix: &str| {
        Finding::new(check, status, detail, Some(fix.to_string()))
    };
    let Some(so) = so else {
        return finding(
            Status::Warn,
            "not checked: no plugin file to read (see plugstack)".into(),
            "fix the plugstack check first",
        );
    };
    let rebuild = format!(
        "rebuild the plugin against this Slurm's headers (libslurm-dev of the running Slurm: cargo build --release) and install it as {}",
        so.display()
    );
    let plugin = match plugin {
        Ok(v) => v,
        Err(e) => {
            let detail = format!(
                "not checked: cannot read plugin_version from {}: {e}",
                so.display()
            );
            return finding(Status::Warn, detail, &rebuild);
        }
    };
    let slurm = match slurm {
        Ok(v) => v,
        Err(e) => {
            let detail = format!(
                "plugin built for Slurm {}; not compared: the running Slurm's version is unknown ({e})",
                version_text(plugin)
            );
            let fix = "make scontrol runnable on this node (scontrol --version)";
            return finding(Status::Warn, detail, fix);
        }
    };
    let (p, s) = (version_text(plugin), version_text(slurm));
    if plugin == slurm {
        Finding::new(
            check,
            Status::Pass,
            format!("{} built for Slurm {p}, the running one", so.display()),
            None,
        )
    } else if plugin >> 8 == slurm >> 8 {
        let detail = format!(
            "{} built for Slurm {p}, running {s}: Slurm loads it (same release), but it was built against other headers",
            so.display()
        );
        finding(Status::Warn, detail, &rebuild)
    } else {
        let detail = format!(
            "{} built for Slurm {p}, running {s}: Slurm refuses to load a plugin of another release",
            so.display()
        );
        finding(Status::Fail, detail, &rebuild)
    }
}

/// sluice needs the prolog (which starts staging) to run at allocation: `Alloc`, or `Contain`,
/// which implies it.
pub fn judge_prolog_flags(conf: Option<&SlurmConf>) -> Finding {
    let check = "prolog flags";
    let fix = "add PrologFlags=Alloc to slurm.conf (slurm-conf/slurm.conf.snippet), then restart slurmctld and slurmd".to_string();
    let Some(conf) = conf else {
        return Finding::new(
            check,
            Status::Warn,
            "not checked: neither scontrol show config nor slurm.conf could be read".into(),
            Some(
                "run doctor where scontrol reaches slurmctld, or as root to read slurm.conf".into(),
            ),
        );
    };
    let value = conf.get("PrologFlags").unwrap_or("");
    let has = |flag: &str| {
        value
            .split(',')
            .any(|f| f.trim().eq_ignore_ascii_case(flag))
    };
    if has("Alloc") || has("Contain") {
        Finding::new(
            check,
            Status::Pass,
            format!("PrologFlags={value} ({})", conf.source),
            None,
        )
    } else {
        let shown = if value.is_empty() { "(none)" } else { value };
        Finding::new(
            check,
            Status::Warn,
            format!(
                "PrologFlags={shown} ({}) lacks Alloc: the prolog, and so stage-in, waits for each node's first step instead of starting when the job is allocated",
                conf.source
            ),
            Some(fix),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn show_config_and_slurm_conf_give_the_same_keys() {
        let shown = "Configuration data as of 2026-12-01T10:00:00\nPlugStackConfig         = /etc/slurm/plugstack.conf\nPrologFlags             = Alloc,Contain\nSLURM_VERSION           = 22.05.8\n";
        let m = parse_show_config(shown);
        assert_eq!(m["plugstackconfig"], "/etc/slurm/plugstack.conf");
        assert_eq!(m["prologflags"], "Alloc,Contain");
        let conf = "# comment\nPlugStackConfig=/etc/slurm/p.conf # here\nprologflags=Alloc\nNodeName=n1 Port=1\n";
        let m = parse_slurm_conf(conf);
        assert_eq!(m["plugstackconfig"], "/etc/slurm/p.conf");
        assert_eq!(m["prologflags"], "Alloc");
        assert_eq!(m["nodename"], "n1");
        assert!(!m.contains_key("port"));
    }

    #[test]
    fn plugstack_lines_commented_optional_and_includes() {
        let text = "# required /x/spank_sluice.so\n\
                    optional /usr/lib/other.so a=b\n  \n\
                    required   /usr/local/lib/sluice/spank_sluice.so socket=/run/sluice/%n.sock # note\n\
                    include /etc/slurm/plugstack.conf.d/*.conf\n\
                    garbage line here\n";
        assert_eq!(
            parse_plugstack(text),
            vec![
                PlugLine::Plugin {
                    required: false,
                    path: "/usr/lib/other.so".into(),
                    line: 2
                },
                PlugLine::Plugin {
                    required: true,
                    path: "/usr/local/lib/sluice/spank_sluice.so".into(),
                    line: 4
                },
                PlugLine::Include {
                    pattern: "/etc/slurm/plugstack.conf.d/*.conf".into()
                },
            ]
        );
        assert!(glob_match("*.conf", "sluice.conf"));
        assert!(!glob_match("*.conf", "sluice.conf.bak"));
        assert!(glob_match("s?uice*", "sluice.conf"));
    }

    fn judge(text: &str, exists: bool) -> Finding {
        let main = PathBuf::from("/etc/slurm/plugstack.conf");
        let files = vec![(main.clone(), parse_plugstack(text))];
        let lines = sluice_lines(&files, Some("/usr/lib/slurm"));
        judge_plugstack(&main, Ok(()), std::slice::from_ref(&main), &lines, |_| {
            exists
        })
    }

    #[test]
    fn plugstack_required_passes_optional_warns_missing_fails() {
        let ok = judge(
            "required /usr/local/lib/sluice/spank_sluice.so socket=x\n",
            true,
        );
        assert_eq!(ok.status, Status::Pass, "{ok:?}");
        assert!(ok.detail.contains("plugstack.conf:1"), "{ok:?}");

        let optional = judge("optional /usr/local/lib/sluice/spank_sluice.so\n", true);
        assert_eq!(optional.status, Status::Warn);
        assert!(
            optional.detail.contains("does not stop the job"),
            "{optional:?}"
        );
        assert!(optional.fix.unwrap().contains("`required`"));

        for missing in [
            "",
            "# required /usr/local/lib/sluice/spank_sluice.so\n",
            "required /x/other.so\n",
        ] {
            let f = judge(missing, true);
            assert_eq!(f.status, Status::Fail, "{missing:?}");
            assert!(f.fix.unwrap().contains(PLUGSTACK_LINE));
        }

        let gone = judge("required /usr/local/lib/sluice/spank_sluice.so\n", false);
        assert_eq!(gone.status, Status::Fail);
        assert!(gone.detail.contains("does not exist"), "{gone:?}");

        let twice = judge(
            "required /a/spank_sluice.so\nrequired /b/libspank_sluice.so\n",
            true,
        );
        assert_eq!(twice.status, Status::Warn);

        // A relative path is PluginDir's.
        let rel = judge("required spank_sluice.so\n", true);
        assert!(
            rel.detail.contains("/usr/lib/slurm/spank_sluice.so"),
            "{rel:?}"
        );

        let main = PathBuf::from("/nope");
        let unreadable = judge_plugstack(&main, Err("No such file".into()), &[], &[], |_| true);
        assert_eq!(unreadable.status, Status::Fail);
    }

    #[test]
    fn slurm_versions_compare_by_release() {
        assert_eq!(parse_slurm_version("slurm-wlm 22.05.8\n"), Some(0x160508));
        assert_eq!(parse_slurm_version("slurm 23.11.10"), Some(0x170b0a));
        assert_eq!(parse_slurm_version("slurm 24.05.0-0rc1"), Some(0x180500));
        assert_eq!(parse_slurm_version("nonsense"), None);
        assert_eq!(version_text(0x160508), "22.05.8");
        let so = Path::new("/p.so");
        let j = |p, s| judge_plugin_version(Some(so), Ok(p), Ok(s)).status;
        assert_eq!(j(0x160508, 0x160508), Status::Pass);
        assert_eq!(j(0x160507, 0x160508), Status::Warn);
        assert_eq!(j(0x170b00, 0x160508), Status::Fail);
        let f = judge_plugin_version(Some(so), Ok(0x170b00), Ok(0x160508));
        assert!(
            f.detail.contains("23.11.0") && f.detail.contains("22.05.8"),
            "{f:?}"
        );
        assert!(f.fix.unwrap().contains("rebuild"));
        assert_eq!(
            judge_plugin_version(None, Ok(1), Ok(1)).status,
            Status::Warn
        );
        assert_eq!(
            judge_plugin_version(Some(so), Err("x".into()), Ok(1)).status,
            Status::Warn
        );
    }

    #[test]
    fn plugin_version_is_read_from_an_elf_file() {
        // This test binary is an ELF file too; it has no plugin_version, and says so.
        let me = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        assert!(plugin_version(&me).unwrap_err().contains("plugin_version"));
        assert!(plugin_version(b"#!/bin/sh\n").unwrap_err().contains("ELF"));
    }

    #[test]
    fn prolog_flags_need_alloc_or_contain() {
        let conf = |v: &str| SlurmConf {
            source: "scontrol show config".into(),
            values: [("prologflags".to_string(), v.to_string())].into(),
        };
        assert_eq!(
            judge_prolog_flags(Some(&conf("Alloc"))).status,
            Status::Pass
        );
        assert_eq!(
            judge_prolog_flags(Some(&conf("Contain,X11"))).status,
            Status::Pass
        );
        let none = judge_prolog_flags(Some(&conf("(null)")));
        assert_eq!(none.status, Status::Warn);
        assert!(none.fix.unwrap().contains("PrologFlags=Alloc"));
        assert_eq!(
            judge_prolog_flags(Some(&conf("Serial"))).status,
            Status::Warn
        );
        assert_eq!(judge_prolog_flags(None).status, Status::Warn);
    }
}
