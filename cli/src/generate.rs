//! `sluice generate man DIR` and `sluice generate completions SHELL`: the man pages and shell
//! completions, rendered from the clap definitions that parse the command line, so they describe
//! exactly the binary they come from. The install steps of docs/admin-guide.md run them. They are no part of the
//! interface users see: `main` parses them (with [`Internal`]) only when the first argument is
//! `generate`, before and apart from [`crate::Cli`], so neither `sluice --help`, the pages nor the
//! completions offer them. (A hidden clap subcommand would still be completed: clap_complete
//! completes hidden subcommands.)

use anyhow::Context;
use clap::{CommandFactory, Parser, Subcommand};
use clap_mangen::Man;
use clap_mangen::roff::{Roff, bold, roman};
use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The exit statuses of a command, with what each means: shown by `--help` (see
/// [`exit_status_help`]) and in the EXIT STATUS section of every man page.
pub type ExitCodes = &'static [(u8, &'static str)];

/// The commands for installing sluice, parsed apart from [`crate::Cli`].
#[derive(Debug, Parser)]
#[command(name = "sluice", about = "Commands for installing sluice")]
pub struct Internal {
    #[command(subcommand)]
    pub command: InternalCommand,
}

#[derive(Debug, Subcommand)]
pub enum InternalCommand {
    /// Render the man pages or the shell completions
    #[command(subcommand)]
    Generate(Generate),
}

#[derive(Debug, Subcommand)]
pub enum Generate {
    /// Write one man page per command (sluice.1, sluice-ckpt.1, sluice-ckpt-list.1, ...) into DIR,
    /// creating it if needed, and print each file's path
    Man {
        /// Where the pages go, e.g. /usr/local/share/man/man1
        dir: PathBuf,
    },
    /// Print the completion script for SHELL on stdout
    Completions {
        /// The shell: bash, zsh, fish, elvish or powershell
        shell: clap_complete::Shell,
    },
}

/// Whether `args` (the whole command line) is one of [`Internal`]'s commands: its first argument
/// names one of them.
pub fn is_internal(args: &[OsString]) -> bool {
    let Some(first) = args.get(1) else {
        return false;
    };
    Internal::command()
        .get_subcommands()
        .any(|c| first.to_str() == Some(c.get_name()))
}

/// What a man page says about its program, beyond what clap knows.
pub struct Manual {
    /// The man section: "1" for user commands, "8" for daemons.
    pub section: &'static str,
    /// The page header's centre, e.g. "sluice manual".
    pub manual: &'static str,
    /// The footer, e.g. "sluice 0.1.0".
    pub source: String,
    pub exit_codes: ExitCodes,
}

/// Runs `generate` for the program `cmd`, returning what goes to stdout.
pub fn run(generate: Generate, cmd: clap::Command, manual: &Manual) -> anyhow::Result<String> {
    match generate {
        Generate::Man { dir } => {
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            let written = man_pages(cmd, &dir, manual)
                .with_context(|| format!("writing man pages into {}", dir.display()))?;
            Ok(written
                .iter()
                .map(|p| format!("{}\n", p.display()))
                .collect())
        }
        Generate::Completions { shell } => completions(cmd, shell),
    }
}

/// The completion script for `shell`.
pub fn completions(mut cmd: clap::Command, shell: clap_complete::Shell) -> anyhow::Result<String> {
    let name = cmd.get_name().to_string();
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut cmd, name, &mut script);
    String::from_utf8(script).context("the completion script is not UTF-8")
}

/// `--help`'s note on exit statuses (the man pages render the same table as EXIT STATUS).
pub fn exit_status_help(codes: ExitCodes) -> String {
    let mut text = String::from("Exit status:");
    for (code, meaning) in codes {
        text += &format!("\n  {code}  {meaning}");
    }
    text
}

/// Writes a page for `cmd` and one for each of its subcommands, recursively (`sluice-ckpt-list`
/// for `sluice ckpt list`), into `dir`; returns the files written.
pub fn man_pages(cmd: clap::Command, dir: &Path, manual: &Manual) -> std::io::Result<Vec<PathBuf>> {
    // `sluice help ckpt` needs no page; building sets every subcommand's display name
    // (sluice-ckpt-list) and bin name (sluice ckpt list), which the pages are titled with.
    let mut cmd = cmd.disable_help_subcommand(true);
    cmd.build();
    let mut written = Vec::new();
    write_pages(&cmd, None, dir, manual, &mut written)?;
    Ok(written)
}

fn write_pages(
    cmd: &clap::Command,
    parent: Option<&str>,
    dir: &Path,
    manual: &Manual,
    written: &mut Vec<PathBuf>,
) -> std::io::Result<()> {
    let path = dir.join(format!("{}.{}", page_name(cmd), manual.section));
    std::fs::write(&path, page(cmd, parent, manual)?)?;
    written.push(path);
    for sub in visible_subcommands(cmd) {
        write_pages(sub, Some(page_name(cmd)), dir, manual, written)?;
    }
    Ok(())
}

fn page_name(cmd: &clap::Command) -> &str {
    cmd.get_display_name().unwrap_or_else(|| cmd.get_name())
}

fn visible_subcommands(cmd: &clap::Command) -> impl Iterator<Item = &clap::Command> {
    cmd.get_subcommands().filter(|c| !c.is_hide_set())
}

/// One page: clap_mangen's sections, in the order of man-pages(7), with EXIT STATUS and SEE ALSO
/// (the parent's page and the subcommands') added.
fn page(cmd: &clap::Command, parent: Option<&str>, manual: &Manual) -> std::io::Result<Vec<u8>> {
    // The section names the subcommands' pages (sluice-ckpt(1)).
    let man = Man::new(cmd.clone()).section(manual.section);
    let mut out = Vec::new();
    // clap_mangen writes an empty date as nothing, which shifts the source and manual into the
    // date's and source's places in man's header and footer.
    writeln!(
        out,
        ".TH {} {} \"\" \"{}\" \"{}\"",
        page_name(cmd),
        manual.section,
        manual.source,
        manual.manual
    )?;
    man.render_name_section(&mut out)?;
    man.render_synopsis_section(&mut out)?;
    man.render_description_section(&mut out)?;
    if cmd.get_arguments().any(|a| !a.is_hide_set()) {
        man.render_options_section(&mut out)?;
    }
    if visible_subcommands(cmd).next().is_some() {
        man.render_subcommands_section(&mut out)?;
    }
    let mut roff = Roff::new();
    roff.control("SH", ["EXIT STATUS"]);
    for (code, meaning) in manual.exit_codes {
        roff.control("TP", []);
        roff.text([bold(code.to_string())]);
        roff.text([roman(*meaning)]);
    }
    roff.to_writer(&mut out)?;
    if cmd.get_version().is_some() {
        man.render_version_section(&mut out)?;
    }
    let see_also: Vec<String> = parent
        .into_iter()
        .chain(visible_subcommands(cmd).map(page_name))
        .map(|name| format!("{name}({})", manual.section))
        .collect();
    if !see_also.is_empty() {
        let mut roff = Roff::new();
        roff.control("SH", ["SEE ALSO"]);
        roff.text([roman(see_also.join(", "))]);
        roff.to_writer(&mut out)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn internal_definition_is_consistent_and_recognised() {
        Internal::command().debug_assert();
        let args = |a: &[&str]| a.iter().map(OsString::from).collect::<Vec<_>>();
        assert!(is_internal(&args(&["sluice", "generate", "man", "/d"])));
        // Only as the first argument: a value or a later word is never taken for it.
        assert!(!is_internal(&args(&["sluice", "--socket", "generate"])));
        assert!(!is_internal(&args(&["sluice", "ckpt", "list", "generate"])));
        assert!(!is_internal(&args(&["sluice"])));
    }
}
