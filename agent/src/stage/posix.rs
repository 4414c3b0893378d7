//! Stage-in from POSIX sources (Lustre, NFS, GPFS, local paths): the agent's side of
//! `sluiced copy-as-user` — it starts the helper as the job user, turns the helper's progress lines
//! into [`Progress`], and its exit code and last error line into the [`StageError`] the job shows.

use super::copy_as_user::{EXIT_DENIED, EXIT_NO_SPACE, EXIT_NOT_FOUND, Event};
use super::{Progress, ShardPlan, StageCtx, StageError};
use sluice_proto::msg::StageState;
use sluice_proto::options::StageSpec;
use tokio::io::{AsyncBufReadExt, AsyncReadExt};

/// Copies a POSIX source with the job user's identity, through `sluiced copy-as-user`; with
/// `shard`, only this node's share of its files, and the manifest.
pub(super) async fn stage(
    ctx: &StageCtx,
    spec: &StageSpec,
    path: &str,
    progress: &Progress,
    shard: Option<&ShardPlan>,
) -> Result<(), StageError> {
    let source = spec.source.to_string();
    let dest = ctx.stage_path.join(&spec.name);
    let mut command = tokio::process::Command::new(&ctx.helper_exe);
    command.arg("copy-as-user");
    if let Some(plan) = shard {
        command
            .arg("--shard-nodes")
            .arg(plan.nodes_arg())
            .arg("--shard-node")
            .arg(plan.node())
            .arg("--dataset")
            .arg(&spec.name)
            .arg("--source")
            .arg(&source);
        if let Some(layout) = &ctx.shared_tier {
            command.arg("--shared-tier").args(layout.helper_args());
        }
    }
    let mut child = command
        .arg("--uid")
        .arg(ctx.owner.uid.to_string())
        .arg("--gid")
        .arg(ctx.owner.gid.to_string())
        .arg("--user")
        .arg(&ctx.user)
        .arg("--src")
        .arg(path)
        .arg("--dst")
        .arg(&dest)
        .env_clear()
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| StageError::Origin {
            dataset: source.clone(),
            detail: format!("cannot start the copy helper: {e}"),
        })?;
    let stdout = child.stdout.take().expect("stdout is piped");
    let mut stderr = child.stderr.take().expect("stderr is piped");
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        if let Some(event) = Event::parse(&line) {
            progress.apply(event);
            if matches!(event, Event::Total { .. }) {
                progress.set_state(StageState::Copying);
            }
        }
    }
    let mut err_text = String::new();
    let _ = (&mut stderr)
        .take(64 * 1024)
        .read_to_string(&mut err_text)
        .await;
    let status = child.wait().await.map_err(|e| StageError::Origin {
        dataset: source.clone(),
        detail: e.to_string(),
    })?;
    if status.success() {
        return Ok(());
    }
    let message = err_text
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("copy helper failed")
        .to_string();
    Err(classify(&source, &ctx.cfg.node, status.code(), message))
}

/// Turns the helper's exit into the error the job will show.
fn classify(source: &str, node: &str, code: Option<i32>, message: String) -> StageError {
    match code {
        Some(EXIT_NOT_FOUND) => StageError::NotFound {
            dataset: source.to_string(),
        },
        Some(EXIT_DENIED) => StageError::Denied {
            dataset: source.to_string(),
            detail: message,
        },
        Some(EXIT_NO_SPACE) => StageError::NoSpace {
            node: node.to_string(),
            dataset: source.to_string(),
        },
        _ => StageError::Origin {
            dataset: source.to_string(),
            detail: message,
        },
    }
}
