//! `kubectl outbox check|audit|replay|dead-letters NAME [options]`: the binary's tools
//! run in the cluster, in a Job shaped like the relay's own pods
//! ([`crate::resources::tool_job`]): the relay's Secrets, service account and network,
//! so no credential is copied out and no port-forward is needed. The plugin waits for
//! the tool to end, prints its report (the container's termination message, read from
//! the API) and exits as the tool did: 0 nothing found, 1 findings, 2 could not tell.

use std::time::Duration;

use clap::Parser;
use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use kube::runtime::watcher;

use super::{failed, refused};
use crate::Error;
use crate::api::OutboxRelay;
use crate::resources::{Ended, TOOL_JOB_KEPT_SECONDS, TOOL_MANIFEST_PATH, ToolRun, pod_ended};

/// A tool's command line as the Job will run it, read here first so a mistake is
/// refused before anything is created.
#[derive(Debug, Parser)]
#[command(name = "outbox-operator", no_binary_name = true)]
enum ToolLine {
    Check(crate::check::CheckArgs),
    Audit(crate::audit::AuditArgs),
    Replay(crate::replay::ReplayArgs),
    DeadLetters(crate::dead_letters::DeadLetterArgs),
}

/// The command line of `tool` with `args`, reading the relay's manifest as the Job
/// gives it; refused as the tool itself would refuse it.
pub fn tool_line(tool: &str, args: &[String]) -> Result<Vec<String>, String> {
    if args.iter().any(|a| {
        a == "-f" || a.starts_with("--file") || (a.starts_with("-f") && !a.starts_with("--"))
    }) {
        return Err(format!(
            "{tool} runs against the relay named: leave -f out (the Job gives the tool the relay's own manifest)"
        ));
    }
    let mut line = vec![
        tool.to_owned(),
        "-f".to_owned(),
        TOOL_MANIFEST_PATH.to_owned(),
    ];
    line.extend(args.iter().cloned());
    ToolLine::try_parse_from(&line).map_err(|e| e.render().to_string())?;
    Ok(line[3..].to_vec())
}

/// Runs `tool` with `args` against the relay `name` in `namespace`; waits at most
/// `deadline` for it. Returns the Job's name and how the tool ended.
pub async fn run_tool(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    tool: &str,
    args: &[String],
    deadline: Duration,
) -> Result<(String, Ended), Error> {
    let args = tool_line(tool, args).map_err(failed)?;
    let relays: Api<OutboxRelay> = Api::namespaced(client.clone(), namespace);
    let relay = relays
        .get_opt(name)
        .await
        .map_err(refused)?
        .ok_or_else(|| failed(format!("no OutboxRelay {name} in namespace {namespace}")))?;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), namespace);
    let deployment_name = crate::resources::relay_object_name(&relay);
    let deployment = deployments
        .get_opt(&deployment_name)
        .await
        .map_err(refused)?
        .ok_or_else(|| {
            failed(format!(
                "the relay {name} has no Deployment ({deployment_name}) to take its pods' settings from yet: kubectl describe outboxrelay {name} says why"
            ))
        })?;
    let run = ToolRun {
        tool: tool.to_owned(),
        args,
        deadline,
    };
    let job = crate::resources::tool_job(&relay, &deployment, &run).map_err(failed)?;
    let jobs: Api<Job> = Api::namespaced(client.clone(), namespace);
    let job = jobs
        .create(&PostParams::default(), &job)
        .await
        .map_err(refused)?;
    let job_name = job.metadata.name.clone().unwrap_or_default();
    // The pod may outlive the Job's deadline by its grace period; a little more.
    let wait = deadline + Duration::from_secs(60);
    let ended = tokio::time::timeout(wait, ended(client, namespace, &job_name))
        .await
        .map_err(|_| {
            failed(format!(
                "job.batch/{job_name} did not end within {}s: kubectl describe job {job_name}",
                wait.as_secs()
            ))
        })??;
    Ok((job_name, ended))
}

/// Watches the Job's pod until its tool ends, or it cannot start.
async fn ended(client: &kube::Client, namespace: &str, job: &str) -> Result<Ended, Error> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let config = watcher::Config::default().labels(&crate::resources::job_pods_selector(job));
    let mut events = std::pin::pin!(watcher::watcher(pods, config));
    while let Some(event) = events.next().await {
        let event = event.map_err(|e| failed(format!("watching job {job}'s pod: {e}")))?;
        let pod = match event {
            watcher::Event::Apply(pod) | watcher::Event::InitApply(pod) => pod,
            _ => continue,
        };
        if let Some(ended) = pod_ended(&pod) {
            return Ok(ended);
        }
    }
    Err(failed(format!("the watch of job {job}'s pod ended")))
}

/// The plugin's exit status for the tool's: 0 and 1 as the tool said; anything else
/// (2, a kill, a signal) 2: it could not tell.
pub fn exit_status(code: i32) -> u8 {
    match code {
        0 => 0,
        1 => 1,
        _ => 2,
    }
}

/// What the plugin tells on stderr once the tool ended: where the whole log is.
pub fn epilogue(job: &str, ended: &Ended) -> String {
    format!(
        "job.batch/{job} ended with exit status {}; its whole log: kubectl logs job/{job} (kept {} minutes)",
        ended.exit_code,
        TOOL_JOB_KEPT_SECONDS / 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn a_tools_options_are_read_before_the_job_is_made() {
        assert_eq!(
            tool_line("audit", &args(&["--since", "2h"])).unwrap(),
            ["--since", "2h"]
        );
        assert_eq!(tool_line("check", &[]).unwrap(), Vec::<String>::new());
        let refused = tool_line("replay", &args(&["--sinse", "2h"])).unwrap_err();
        assert!(refused.contains("--sinse"), "{refused}");
        let refused = tool_line("audit", &args(&["-f", "x.yaml"])).unwrap_err();
        assert!(refused.contains("leave -f out"), "{refused}");
        let refused = tool_line("dead-letters", &args(&["--file=x.yaml"])).unwrap_err();
        assert!(refused.contains("leave -f out"), "{refused}");
        assert!(tool_line("dead-letters", &args(&["--redrive", "all"])).is_ok());
    }
}
