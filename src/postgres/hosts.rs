//! Multi-host URLs (`postgres://u@db-a,db-b/app`, as drivers and HA setups write them):
//! every connection of a relay and of the operator must reach the primary, which can be
//! any of the hosts after a switchover.
//!
//! The driver's own connections take the first host that accepts writes
//! (`target_session_attrs=read-write`, set whenever a URL names several hosts). The
//! replication connection is made by another library, which takes one host: it goes to
//! the host the relay's normal session reached, found by matching the server's address
//! (`inet_server_addr()`) against what each host of the URL resolves to, so that TLS
//! still verifies the name written in the URL.

use std::net::IpAddr;

use tokio_postgres::Client;
use tokio_postgres::config::{Host, TargetSessionAttrs};

/// Several hosts and no preference written: prefer the one that accepts writes.
pub fn prefer_primary(config: &mut tokio_postgres::Config) {
    if config.get_hosts().len() > 1 && config.get_target_session_attrs() == TargetSessionAttrs::Any
    {
        config.target_session_attrs(TargetSessionAttrs::ReadWrite);
    }
}

/// The host and port of `config` that `client` is connected to, when `config` names
/// several TCP hosts and one of them resolves to the server's address; `None` when it
/// names one (use it) or none matches (the first is used, as before).
pub async fn connected_host(
    client: &Client,
    config: &tokio_postgres::Config,
) -> Option<(String, u16)> {
    let hosts = config.get_hosts();
    if hosts.len() < 2 {
        return None;
    }
    let row = client
        .query_one("SELECT host(inet_server_addr()), inet_server_port()", &[])
        .await
        .ok()?;
    let ip: IpAddr = row.get::<_, Option<String>>(0)?.parse().ok()?;
    let port = u16::try_from(row.get::<_, Option<i32>>(1)?).ok()?;
    let ports = config.get_ports();
    for (i, host) in hosts.iter().enumerate() {
        let Host::Tcp(name) = host else {
            continue;
        };
        let host_port = ports
            .get(i)
            .or_else(|| (ports.len() == 1).then(|| &ports[0]))
            .copied()
            .unwrap_or(5432);
        if host_port != port {
            continue;
        }
        let resolves_to_server = match name.parse::<IpAddr>() {
            Ok(literal) => literal == ip,
            Err(_) => tokio::net::lookup_host((name.as_str(), host_port))
                .await
                .is_ok_and(|mut found| found.any(|a| a.ip() == ip)),
        };
        if resolves_to_server {
            return Some((name.clone(), host_port));
        }
    }
    None
}
