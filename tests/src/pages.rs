//! What the tests of the two binaries' install steps share (agent/tests/sluiced_cli.rs for
//! `sluiced`, cli/tests/generate.rs for `sluice`): running a [`Binary`], rendering a man page the
//! way man(1) shows it to a user ([`man`], [`section`]), loading a shell completion the way bash
//! does ([`Binary::bash_complete`]), the "Exit status:" lines of `--help` ([`exit_statuses`]), and
//! the install steps of docs/admin-guide.md ([`Binary::run_admin_guide_install_steps`]).
//!
//! A check that needs a program this machine lacks (man, zsh, fish) fails through [`require`] and
//! says what to install (tests/harness/install.sh installs them all): it never passes unchecked.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// One of sluice's binaries, as its tests run it.
pub struct Binary {
    /// The name it is installed and completed as (`sluice`, `sluiced`).
    pub name: &'static str,
    /// Its path (`env!("CARGO_BIN_EXE_…")`).
    pub path: &'static str,
    /// The variables of the test's environment it must not see (they would change what it does).
    pub unset: &'static [&'static str],
}

impl Binary {
    /// Runs it with `args`, without the variables in [`Binary::unset`].
    pub fn run(&self, args: &[&str]) -> Output {
        let mut command = Command::new(self.path);
        command.args(args);
        for var in self.unset {
            command.env_remove(var);
        }
        command.output().unwrap()
    }

    /// Runs it with `args`, which must exit with `code`: what it wrote to stderr.
    #[track_caller]
    pub fn exits(&self, args: &[&str], code: i32) -> String {
        let out = self.run(args);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{stderr}");
        stderr
    }

    /// Checks that `NAME --version` says `NAME VERSION (protocol PROTOCOL)`.
    #[track_caller]
    pub fn assert_version(&self, version: &str, protocol: impl std::fmt::Display) {
        assert_eq!(
            succeeded(&self.run(&["--version"])),
            format!("{} {version} (protocol {protocol})\n", self.name)
        );
    }

    /// Checks that its `--help` and `-h` list, under "Exit status:", the statuses 0, 1 and 2 as
    /// lines that start with `statuses`, and that it returns them: 2 for the arguments
    /// `usage_error`, 1 for `failure`, saying what failed after its name. Returns the two helps.
    #[track_caller]
    pub fn assert_exit_statuses(
        &self,
        statuses: [&str; 3],
        usage_error: &[&str],
        failure: &[&str],
    ) -> [String; 2] {
        self.exits(usage_error, 2);
        assert_has(&self.exits(failure, 1), &format!("{}: ", self.name));
        ["--help", "-h"].map(|flag| {
            let help = succeeded(&self.run(&[flag]));
            let listed = exit_statuses(&help);
            assert!(listed.len() >= statuses.len(), "{help}");
            for (line, status) in listed.iter().zip(statuses) {
                assert!(line.starts_with(status), "{status:?} in:\n{help}");
            }
            help
        })
    }

    /// `NAME generate completions SHELL` in `dir` ([`Binary::completion_script`]), checked the
    /// way SHELL loads it: its syntax (`bash -n`, `zsh -n -f`, `fish --no-execute`), and for zsh
    /// the `#compdef NAME` line compinit looks for. Fails unless SHELL is installed.
    #[track_caller]
    pub fn checked_completion(&self, shell: &str, dir: &Path) -> PathBuf {
        require(shell, &format!("the {shell} completion"));
        let script = self.completion_script(shell, dir);
        let check: &[&str] = match shell {
            "bash" => &["-n"],
            "zsh" => &["-n", "-f"],
            "fish" => &["--no-execute"],
            other => panic!("no syntax check for {other}"),
        };
        if shell == "zsh" {
            let source = std::fs::read_to_string(&script).unwrap();
            let compdef = format!("#compdef {}\n", self.name);
            assert!(source.starts_with(&compdef), "{source}");
        }
        parses(shell, check, &script);
        script
    }

    /// `NAME generate completions SHELL`, written to the file `NAME.SHELL` in `dir`.
    pub fn completion_script(&self, shell: &str, dir: &Path) -> PathBuf {
        let script = succeeded(&self.run(&["generate", "completions", shell]));
        let path = dir.join(format!("{}.{shell}", self.name));
        std::fs::write(&path, script).unwrap();
        path
    }

    /// What bash offers for the command line `words` (the last one the word being completed, ""
    /// after a space), with the completion `script` loaded as bash-completion would: source it,
    /// ask `complete -p NAME` which function it registered, and call that with COMP_WORDS and
    /// COMP_CWORD set.
    pub fn bash_complete(&self, script: &Path, words: &[&str]) -> Vec<String> {
        let driver = r#"
            name=$1; script=$2; shift 2
            source "$script" || exit 1
            spec=$(complete -p "$name") || exit 1
            [[ $spec =~ -F\ ([^ ]+) ]] || { echo "no completion function in: $spec" >&2; exit 1; }
            COMP_WORDS=("$@")
            COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 ))
            COMP_LINE="${COMP_WORDS[*]}"
            COMP_POINT=${#COMP_LINE}
            prev=""
            (( COMP_CWORD > 0 )) && prev=${COMP_WORDS[COMP_CWORD-1]}
            "${BASH_REMATCH[1]}" "$name" "${COMP_WORDS[COMP_CWORD]}" "$prev"
            printf '%s\n' "${COMPREPLY[@]}"
        "#;
        let out = Command::new("bash")
            .args(["--norc", "--noprofile", "-c", driver, "bash", self.name])
            .arg(script)
            .args(words)
            .output()
            .unwrap();
        succeeded(&out).lines().map(str::to_string).collect()
    }

    /// The install steps of docs/admin-guide.md for this binary (its `NAME generate …` lines, with
    /// their `> FILE`), run as an admin runs them but with every absolute path under `root`. Also
    /// checks that there are at least three, that the steps' `install -d` creates the directory
    /// of every `> FILE`, and that they installed each of `files` (paths below `root`) and the
    /// bash completion, whose path this returns (bash-completion's `completions/NAME`, loaded
    /// when NAME is first completed).
    #[track_caller]
    pub fn run_admin_guide_install_steps(&self, root: &Path, files: &[&str]) -> PathBuf {
        let guide = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../docs/admin-guide.md"
        ))
        .unwrap();
        let lines: Vec<&str> = guide.lines().map(str::trim).collect();
        let created: Vec<&str> = lines
            .iter()
            .position(|l| l.starts_with("install -d "))
            .map(|i| {
                let mut words = Vec::new();
                for line in &lines[i..] {
                    words.extend(line.trim_end_matches('\\').split_whitespace());
                    if !line.ends_with('\\') {
                        break;
                    }
                }
                words.split_off(2)
            })
            .unwrap_or_default();
        let prefix = format!("{} generate ", self.name);
        let steps: Vec<&str> = lines
            .iter()
            .filter(|l| l.starts_with(&prefix))
            .map(|l| l.split(" #").next().unwrap().trim())
            .collect();
        assert!(
            steps.len() >= 3,
            "the admin guide's install steps for {}: {steps:?}",
            self.name
        );
        for step in steps {
            let (command, target) = match step.split_once(" > ") {
                Some((command, target)) => (command, Some(target.trim())),
                None => (step, None),
            };
            let args: Vec<String> = command
                .split_whitespace()
                .skip(1)
                .map(|a| under(root, a).to_str().unwrap().to_string())
                .collect();
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let out = succeeded(&self.run(&args));
            if let Some(target) = target {
                let parent = Path::new(target).parent().unwrap().to_str().unwrap();
                assert!(
                    created.contains(&parent),
                    "the admin guide's install -d does not create {parent} for `{step}`: {created:?}"
                );
                let file = under(root, target);
                std::fs::create_dir_all(file.parent().unwrap()).unwrap();
                std::fs::write(file, out).unwrap();
            }
        }
        for file in files {
            assert!(root.join(file).is_file(), "{file} is not installed");
        }
        let bash = root
            .join("usr/share/bash-completion/completions")
            .join(self.name);
        assert!(bash.is_file(), "{} is not installed", bash.display());
        bash
    }
}

/// `path` as it lands under `root` when it is absolute (the admin guide's install steps write to
/// /usr).
fn under(root: &Path, path: &str) -> PathBuf {
    match path.strip_prefix('/') {
        Some(relative) => root.join(relative),
        None => PathBuf::from(path),
    }
}

/// `bytes` as UTF-8 text.
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8(bytes.to_vec()).unwrap()
}

/// The stdout of a run that must have succeeded.
#[track_caller]
pub fn succeeded(out: &Output) -> String {
    assert!(
        out.status.success(),
        "{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

#[track_caller]
pub fn assert_has(text: &str, part: &str) {
    assert!(text.contains(part), "{part:?} is not in:\n{text}");
}

/// Fails unless every one of `words` is among the completions `offered`.
#[track_caller]
pub fn assert_offers(offered: &[String], words: &[&str]) {
    for w in words {
        assert!(
            offered.iter().any(|o| o == w),
            "{w:?} is not offered: {offered:?}"
        );
    }
}

/// Fails the test unless `program` is on PATH, naming the check that needs it and the Debian
/// package to install.
#[track_caller]
pub fn require(program: &str, check: &str) {
    let found = std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|d| d.join(program).is_file()));
    let package = match program {
        "man" => "man-db",
        other => other,
    };
    assert!(
        found,
        "{check} needs {program}, which is not on PATH: install {package} \
         (tests/harness/install.sh installs it)"
    );
}

/// Runs `program ARGS SCRIPT` (a shell's syntax check: `bash -n`, `zsh -n -f`, `fish
/// --no-execute`), which must succeed.
#[track_caller]
pub fn parses(program: &str, args: &[&str], script: &Path) {
    succeeded(
        &Command::new(program)
            .args(args)
            .arg(script)
            .output()
            .unwrap(),
    );
}

/// `man --warnings` as a user's terminal runs it, made the same on every machine: 80 columns, no
/// pager, UTF-8. Add the page (`-l FILE`, or a name and MANPATH).
pub fn man_command() -> Command {
    let mut command = Command::new("man");
    command
        .arg("--warnings")
        .env("MANWIDTH", "80")
        .env("MANPAGER", "cat")
        .env("LC_ALL", "C.UTF-8");
    command
}

/// `man -l PAGE` as a user runs it: the text, after checking that man and groff had nothing to
/// warn about.
#[track_caller]
pub fn man(page: &Path) -> String {
    let out = man_command().arg("-l").arg(page).output().unwrap();
    let stderr = text(&out.stderr);
    assert!(
        out.status.success() && stderr.is_empty(),
        "man -l {}: {:?}\n{stderr}",
        page.display(),
        out.status
    );
    text(&out.stdout)
}

/// The text of section `heading` in a rendered page, its words joined by single spaces (man
/// justifies lines with more).
pub fn section(rendered: &str, heading: &str) -> String {
    rendered
        .lines()
        .skip_while(|l| *l != heading)
        .skip(1)
        .take_while(|l| l.is_empty() || l.starts_with(' '))
        .flat_map(str::split_whitespace)
        .collect::<Vec<_>>()
        .join(" ")
}

/// The lines after "Exit status:" in a `--help`.
pub fn exit_statuses(help: &str) -> Vec<&str> {
    help.lines()
        .skip_while(|l| *l != "Exit status:")
        .skip(1)
        .collect()
}
