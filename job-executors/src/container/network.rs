//! A networked container's boundary: a Docker network of its own, a holder container
//! owning the namespace, a configurator that sets the `prohibit` rules and exits (see
//! the parent module's doc).

use super::*;

/// Where the static busybox appears in the holder and the configurator.
const NET_BUSYBOX: &str = "/byoc-net/busybox";
/// The resolver Docker's DNS is given for a container with an allow-list: reserved
/// (240.0.0.0/4 is never routed) and prohibited in the namespace besides.
const NO_RESOLVER: std::net::IpAddr = std::net::IpAddr::V4(std::net::Ipv4Addr::new(240, 0, 0, 53));
/// The routing table whose only route prohibits everything; the blocked ranges'
/// rules lead there, ahead of the main table.
const PROHIBIT_TABLE: u32 = 199;

/// Whether a networked container's boundary can be built: a static busybox to hold
/// and configure its namespace.
pub fn check_network(settings: &ContainerSettings) -> Result<(), crate::jobnet::NetworkUnavailable> {
    if is_static_elf(&settings.busybox) {
        Ok(())
    } else {
        Err(crate::jobnet::NetworkUnavailable::from(format!(
            "{} is missing or not a static executable; networked containers need it to set up their \
             network boundary (apt-get install busybox-static, or set roles.busybox)",
            settings.busybox.display()
        )))
    }
}

pub fn describe_network(settings: &ContainerSettings) -> String {
    let egress = match &settings.network.allow {
        None => "egress to any address not blocked".to_string(),
        Some(a) => format!(
            "egress allow-list {} entr{}, only listed names resolve (exact names, resolved by the runner at start)",
            a.len(),
            if a.len() == 1 { "y" } else { "ies" }
        ),
    };
    format!("network: own Docker network, {egress}, metadata and host blocked")
}

/// Whether Docker's runtime (runc) failed to create a container's process, before any
/// code in it ran. Seen on test machines whose Docker stores images on fuse-overlayfs,
/// for paths every other start found ("stat /byoc-net/busybox: permission denied",
/// "exec: \"sh\": executable file not found in $PATH"); the same container started at
/// the next try.
fn runc_could_not_create(e: &bollard::errors::Error) -> bool {
    matches!(e, bollard::errors::Error::DockerResponseServerError { message, .. }
        if message.contains("OCI runtime create failed"))
}

/// Starts a created container, and once more if runc could not create its process:
/// nothing in it has run, so a second start is safe. A failure that persists (an
/// image without the command, say) is the second start's error.
pub(super) async fn start_container(
    docker: &Docker,
    id: &str,
    what: &str,
) -> Result<(), bollard::errors::Error> {
    match docker.start_container(id, None).await {
        Err(e) if runc_could_not_create(&e) => {
            tracing::warn!(error = %e, "{what} did not start; trying once more");
            docker.start_container(id, None).await
        }
        started => started,
    }
}

/// The memory ceiling of the holder and the configurator. They need a few MiB, but
/// runc (1.1, as Debian 12 ships it) copies its own ~9 MiB binary into a memfd charged
/// to the container's cgroup while it starts it; at 16 MiB its init was sometimes
/// OOM-killed under load and Docker answered "cannot start a stopped process". A
/// ceiling, not a reservation.
const HELPER_MEMORY_BYTES: i64 = 64 << 20;

/// A networked container's namespace: its Docker network and the holder container.
pub(super) struct JobNetwork {
    network: String,
    pub(super) holder: String,
    /// The `byoc-runner.job` label of its containers: the job's id, or `prepared`.
    label: String,
    /// The image the holder and the configurator run (the host's busybox alone).
    image: String,
    /// The allow-list's names as resolved when the namespace was made (`name:ip`).
    hosts: Vec<String>,
    /// The network's gateways: its own subnet is the container's way out.
    gateways: Vec<std::net::IpAddr>,
    /// Ranges already closed in the namespace.
    closed: std::collections::BTreeSet<byoc_sandbox::net::Cidr>,
}

impl JobNetwork {
    /// A new network named `name`, its containers labelled `label`.
    pub(super) async fn build(
        docker: &Docker,
        settings: &ContainerSettings,
        name: &str,
        label: &str,
    ) -> Result<JobNetwork, crate::jobnet::NetworkUnavailable> {
        use bollard::models::NetworkCreateRequest;
        check_network(settings)?;
        let image = holder_image(docker, settings).await?;
        // Whatever an interrupted attempt of this job left goes first.
        let _ = docker
            .remove_container(
                &format!("{name}-net"),
                Some(RemoveContainerOptionsBuilder::new().force(true).build()),
            )
            .await;
        let _ = docker.remove_network(name).await;
        docker
            .create_network(NetworkCreateRequest {
                name: name.to_string(),
                driver: Some("bridge".into()),
                internal: Some(false),
                labels: Some(labels(label, &settings.owner)),
                options: Some(HashMap::from([(
                    "com.docker.network.bridge.enable_icc".to_string(),
                    "false".to_string(),
                )])),
                ..Default::default()
            })
            .await
            .map_err(|e| docker_error("creating the job's network", e))?;
        let mut net = JobNetwork {
            network: name.to_string(),
            holder: String::new(),
            label: label.to_string(),
            image,
            hosts: Vec::new(),
            gateways: Vec::new(),
            closed: Default::default(),
        };
        match net.finish(docker, settings).await {
            Ok(()) => Ok(net),
            Err(e) => {
                net.remove(docker).await;
                Err(e)
            }
        }
    }

    async fn finish(
        &mut self,
        docker: &Docker,
        settings: &ContainerSettings,
    ) -> Result<(), crate::jobnet::NetworkUnavailable> {
        let info = docker
            .inspect_network(&self.network, None)
            .await
            .map_err(|e| docker_error("inspecting the job's network", e))?;
        let gateways: Vec<std::net::IpAddr> = info
            .ipam
            .and_then(|i| i.config)
            .unwrap_or_default()
            .iter()
            .filter_map(|c| c.gateway.as_deref()?.parse().ok())
            .collect();
        self.gateways = gateways.clone();
        let Some(gateway) = gateways.iter().find(|g| g.is_ipv4()).copied() else {
            return Err(crate::jobnet::NetworkUnavailable(
                "the job's Docker network has no IPv4 gateway".into(),
            ));
        };
        // With an allow-list the runner resolves the listed names, through the
        // resolvers it asks for jobs, and the namespace knows only those (its hosts
        // file): Docker's DNS gets a resolver that can never be reached, so no other
        // name resolves and none leaves the host by lookup.
        let (allow, hosts) = resolve_allowed(settings).await;
        self.hosts = hosts.clone();
        // The holder: owns the namespace (and, for the job's container that joins it,
        // its resolver settings and hosts file), does nothing, holds no capability.
        let holder = ContainerCreateBody {
            image: Some(self.image.clone()),
            entrypoint: Some(vec![NET_BUSYBOX.into(), "sleep".into(), "2147483647".into()]),
            cmd: Some(vec![]),
            user: Some(format!("{}:{}", settings.uid, settings.gid)),
            labels: Some(labels(&self.label, &settings.owner)),
            host_config: Some(HostConfig {
                network_mode: Some(self.network.clone()),
                dns: allow.is_some().then(|| vec![NO_RESOLVER.to_string()]),
                extra_hosts: allow.is_some().then(|| hosts.clone()),
                cap_drop: Some(vec!["ALL".into()]),
                readonly_rootfs: Some(true),
                security_opt: Some(vec!["no-new-privileges".into()]),
                memory: Some(HELPER_MEMORY_BYTES),
                pids_limit: Some(4),
                ..Default::default()
            }),
            ..Default::default()
        };
        let holder_name = format!("{}-net", self.network);
        self.holder = docker
            .create_container(Some(CreateContainerOptionsBuilder::new().name(&holder_name).build()), holder)
            .await
            .map_err(|e| docker_error("creating the network holder", e))?
            .id;
        start_container(docker, &self.holder, "the network holder")
            .await
            .map_err(|e| docker_error("starting the network holder", e))?;
        // The configurator: joins the holder's namespace with CAP_NET_ADMIN only, sets
        // the rules, exits.
        let mut blocked = byoc_sandbox::net::always_blocked();
        blocked.extend(settings.network.deny.iter().copied());
        // The host and the subnets behind its bridges (other jobs' containers), except
        // the container's own subnet: its gateway is its next hop.
        let host = byoc_sandbox::net::host_blocked()
            .map_err(|e| crate::jobnet::NetworkUnavailable(e.to_string()))?;
        blocked.extend(self.closable(host));
        blocked.extend(gateways.iter().map(|g| byoc_sandbox::net::Cidr::host(*g)));
        blocked.sort();
        blocked.dedup();
        if allow.is_some() {
            blocked.push(byoc_sandbox::net::Cidr::host(NO_RESOLVER));
        }
        let script = configure_script(&blocked, allow.as_deref(), gateway);
        self.run_configurator(docker, settings, script).await?;
        self.closed.extend(blocked);
        Ok(())
    }

    /// Make a namespace made ahead fit to be the next job's: its holder still runs, the
    /// allow-list's names resolve as they did, and every host address and subnet that
    /// appeared since is closed before the job starts. `false`: build a fresh one.
    async fn bring_up_to_date(
        &mut self,
        docker: &Docker,
        settings: &ContainerSettings,
    ) -> Result<bool, crate::jobnet::NetworkUnavailable> {
        let running = docker
            .inspect_container(&self.holder, None)
            .await
            .ok()
            .and_then(|c| c.state)
            .and_then(|s| s.running)
            .unwrap_or(false);
        if !running {
            return Ok(false);
        }
        let (_, hosts) = resolve_allowed(settings).await;
        if hosts != self.hosts {
            return Ok(false);
        }
        let host = byoc_sandbox::net::host_blocked()
            .map_err(|e| crate::jobnet::NetworkUnavailable(e.to_string()))?;
        self.close(docker, settings, host).await?;
        Ok(true)
    }

    /// Of `ranges`, those this container's namespace may close: not its own subnet
    /// (its gateway is its next hop; the gateway itself is closed), not what is closed.
    fn closable(&self, ranges: Vec<byoc_sandbox::net::Cidr>) -> Vec<byoc_sandbox::net::Cidr> {
        ranges
            .into_iter()
            .filter(|c| {
                let single = c.prefix_len() == 32 || c.prefix_len() == 128;
                (single || !self.gateways.iter().any(|g| c.contains(*g)))
                    && !self.closed.iter().any(|k| k.covers(c))
            })
            .collect()
    }

    /// Close `ranges` in the running container's namespace (host addresses that
    /// appeared since it started): one more configurator run.
    pub(super) async fn close(
        &mut self,
        docker: &Docker,
        settings: &ContainerSettings,
        ranges: Vec<byoc_sandbox::net::Cidr>,
    ) -> Result<(), crate::jobnet::NetworkUnavailable> {
        let ranges = self.closable(ranges);
        if ranges.is_empty() {
            return Ok(());
        }
        self.run_configurator(docker, settings, close_script(&ranges)).await?;
        self.closed.extend(ranges);
        Ok(())
    }

    /// Run `script` in a configurator that joins the holder's namespace with
    /// CAP_NET_ADMIN only, and wait for it to succeed.
    async fn run_configurator(
        &self,
        docker: &Docker,
        settings: &ContainerSettings,
        script: String,
    ) -> Result<(), crate::jobnet::NetworkUnavailable> {
        let configurator = ContainerCreateBody {
            image: Some(self.image.clone()),
            entrypoint: Some(vec![NET_BUSYBOX.into(), "sh".into(), "-c".into(), script]),
            cmd: Some(vec![]),
            user: Some("0:0".into()),
            labels: Some(labels(&self.label, &settings.owner)),
            network_disabled: Some(false),
            host_config: Some(HostConfig {
                network_mode: Some(format!("container:{}", self.holder)),
                cap_drop: Some(vec!["ALL".into()]),
                cap_add: Some(vec!["NET_ADMIN".into()]),
                readonly_rootfs: Some(true),
                security_opt: Some(vec!["no-new-privileges".into()]),
                memory: Some(HELPER_MEMORY_BYTES),
                pids_limit: Some(16),
                ..Default::default()
            }),
            ..Default::default()
        };
        let cname = format!("{}-netcfg", self.network);
        let _ = docker
            .remove_container(&cname, Some(RemoveContainerOptionsBuilder::new().force(true).build()))
            .await;
        let cid = docker
            .create_container(Some(CreateContainerOptionsBuilder::new().name(&cname).build()), configurator)
            .await
            .map_err(|e| docker_error("creating the network configurator", e))?
            .id;
        let result = async {
            start_container(docker, &cid, "the network configurator")
                .await
                .map_err(|e| docker_error("starting the network configurator", e))?;
            let mut wait = docker.wait_container(&cid, None).boxed();
            let code = match tokio::time::timeout(std::time::Duration::from_secs(60), wait.next()).await {
                Ok(Some(Ok(r))) => r.status_code,
                // bollard reports a non-zero exit as an error carrying the code.
                Ok(Some(Err(bollard::errors::Error::DockerContainerWaitError { code, .. }))) => code,
                Ok(Some(Err(e))) => {
                    return Err(crate::jobnet::NetworkUnavailable::from(docker_error(
                        "waiting for the network configurator",
                        e,
                    )));
                }
                Ok(None) | Err(_) => {
                    return Err(crate::jobnet::NetworkUnavailable(
                        "the network configurator did not finish".into(),
                    ));
                }
            };
            if code != 0 {
                let mut logs = docker
                    .logs(&cid, Some(LogsOptionsBuilder::new().stdout(true).stderr(true).build()))
                    .boxed();
                let mut said = String::new();
                while let Some(Ok(chunk)) = logs.next().await {
                    said.push_str(&String::from_utf8_lossy(&chunk.into_bytes()));
                }
                return Err(crate::jobnet::NetworkUnavailable::from(format!(
                    "setting the container's network rules failed ({code}): {}",
                    said.trim()
                )));
            }
            Ok(())
        }
        .await;
        let _ = docker
            .remove_container(&cid, Some(RemoveContainerOptionsBuilder::new().force(true).build()))
            .await;
        result
    }

    pub(super) async fn remove(&self, docker: &Docker) {
        // A configurator still running (the job ended while it closed a new address).
        let _ = docker
            .remove_container(
                &format!("{}-netcfg", self.network),
                Some(RemoveContainerOptionsBuilder::new().force(true).build()),
            )
            .await;
        if !self.holder.is_empty()
            && let Err(e) = docker
                .remove_container(
                    &self.holder,
                    Some(RemoveContainerOptionsBuilder::new().force(true).build()),
                )
                .await
        {
            tracing::warn!(container = %self.holder, error = %e, "Could not remove the job's network holder: {e}.");
        }
        if let Err(e) = docker.remove_network(&self.network).await {
            tracing::warn!(network = %self.network, error = %e, "Could not remove the job's network: {e}.");
        }
    }
}

/// With an allow-list, the ranges a container may reach (the listed ranges and the
/// addresses of the listed names, resolved by the runner through the resolvers it asks
/// for jobs) and the hosts-file entries (`name:ip`, sorted) that are the only names the
/// namespace knows. Without one: `(None, [])`.
async fn resolve_allowed(
    settings: &ContainerSettings,
) -> (Option<Vec<byoc_sandbox::net::Cidr>>, Vec<String>) {
    let Some(a) = &settings.network.allow else { return (None, Vec::new()) };
    let upstreams = crate::jobnet::upstreams(&settings.network);
    let mut ranges = a.ranges.clone();
    let mut hosts = Vec::new();
    for name in a.hosts.iter().filter(|h| !h.starts_with("*.")) {
        for ip in crate::dns::resolve_v4(&upstreams, name).await {
            ranges.push(byoc_sandbox::net::Cidr::host(ip));
            hosts.push(format!("{name}:{ip}"));
        }
    }
    hosts.sort();
    (Some(ranges), hosts)
}

/// The image the holder and the configurator run: nothing but the host's static
/// busybox, imported once (its tag names the binary's digest), so a namespace can be
/// made before the job's image is known and does not depend on what that image holds.
async fn holder_image(
    docker: &Docker,
    settings: &ContainerSettings,
) -> Result<String, crate::jobnet::NetworkUnavailable> {
    use sha2::Digest as _;
    let unavailable = |e: String| crate::jobnet::NetworkUnavailable(e);
    let busybox = std::fs::read(&settings.busybox)
        .map_err(|e| unavailable(format!("reading {}: {e}", settings.busybox.display())))?;
    let digest = sha2::Sha256::digest(&busybox);
    let tag = hex::encode(&digest[..8]);
    let image = format!("{HOLDER_REPOSITORY}:{tag}");
    if docker.inspect_image(&image).await.is_ok() {
        return Ok(image);
    }
    let mut tar = tar::Builder::new(Vec::new());
    let mut dir = tar::Header::new_gnu();
    dir.set_entry_type(tar::EntryType::Directory);
    dir.set_mode(0o755);
    dir.set_size(0);
    tar.append_data(&mut dir, "byoc-net/", std::io::empty())
        .map_err(|e| unavailable(format!("building the network holder's image: {e}")))?;
    let mut file = tar::Header::new_gnu();
    file.set_mode(0o755);
    file.set_size(busybox.len() as u64);
    tar.append_data(&mut file, NET_BUSYBOX.trim_start_matches('/'), busybox.as_slice())
        .map_err(|e| unavailable(format!("building the network holder's image: {e}")))?;
    let tar =
        tar.into_inner().map_err(|e| unavailable(format!("building the network holder's image: {e}")))?;
    let options = bollard::query_parameters::CreateImageOptionsBuilder::new()
        .from_src("-")
        .repo(HOLDER_REPOSITORY)
        .tag(&tag)
        .build();
    let mut progress = docker.create_image(Some(options), Some(bollard::body_full(tar.into())), None);
    while let Some(step) = progress.next().await {
        step.map_err(|e| unavailable(docker_error("importing the network holder's image", e)))?;
    }
    Ok(image)
}

/// Local repository of the holder's image (`docker images byoc-runner-net`).
const HOLDER_REPOSITORY: &str = "byoc-runner-net";

/// The `byoc-runner.job` label of a namespace made before its job arrived.
const PREPARED_LABEL: &str = "prepared";

/// A networked container's namespace made ahead of its job (the daemon only,
/// `ContainerSettings::prepare_networks`): the next networked container starts
/// without waiting for a network, a holder and a configurator. Each is used once,
/// by one job, and removed with it, as a namespace made for the job is.
struct Prepared {
    /// The settings it was made under: a namespace made under others is not used.
    key: String,
    docker: Docker,
    net: JobNetwork,
}

static PREPARED: std::sync::Mutex<Option<Prepared>> = std::sync::Mutex::new(None);
/// Held while a namespace is made ahead: at most one at a time.
static MAKING: std::sync::LazyLock<std::sync::Arc<tokio::sync::Mutex<()>>> =
    std::sync::LazyLock::new(Default::default);

fn settings_key(settings: &ContainerSettings) -> String {
    format!("{settings:?}")
}

/// The job's namespace: the one made ahead if there is one fit for it (see
/// `bring_up_to_date`), otherwise one made now. `true` with one made ahead. With
/// `prepare_networks`, the next job's is then made in the background.
pub(super) async fn for_job(
    docker: &Docker,
    settings: &ContainerSettings,
    job_id: &str,
) -> Result<(JobNetwork, bool), crate::jobnet::NetworkUnavailable> {
    check_network(settings)?;
    let key = settings_key(settings);
    let ahead = if settings.prepare_networks {
        let mut slot = PREPARED.lock().unwrap_or_else(|e| e.into_inner());
        match slot.take() {
            Some(p) if p.key == key => Some(p.net),
            Some(stale) => {
                tokio::spawn(async move { stale.net.remove(&stale.docker).await });
                None
            }
            None => None,
        }
    } else {
        None
    };
    let result = match ahead {
        Some(mut net) => match net.bring_up_to_date(docker, settings).await {
            Ok(true) => Ok((net, true)),
            stale => {
                if let Err(e) = stale {
                    tracing::warn!(error = %e, "The network made ahead could not be brought up to date; making the job its own: {e}.");
                }
                net.remove(docker).await;
                JobNetwork::build(docker, settings, &format!("byoc-job-{job_id}"), job_id)
                    .await
                    .map(|n| (n, false))
            }
        },
        None => JobNetwork::build(docker, settings, &format!("byoc-job-{job_id}"), job_id)
            .await
            .map(|n| (n, false)),
    };
    if settings.prepare_networks {
        prepare_next(docker, settings);
    }
    result
}

/// Make the next job's namespace in the background, unless one is being made or is
/// ready under the same settings.
fn prepare_next(docker: &Docker, settings: &ContainerSettings) {
    let Ok(making) = MAKING.clone().try_lock_owned() else { return };
    let (docker, settings) = (docker.clone(), settings.clone());
    tokio::spawn(async move {
        let _making = making;
        let key = settings_key(&settings);
        if PREPARED.lock().unwrap_or_else(|e| e.into_inner()).as_ref().is_some_and(|p| p.key == key) {
            return;
        }
        let name = format!("byoc-net-{}", byoc_protocol::random_hex(6));
        tracing::info!(network = %name, "Making a container network ahead of the next networked container.");
        match JobNetwork::build(&docker, &settings, &name, PREPARED_LABEL).await {
            Ok(net) => {
                tracing::info!(network = %name, "Made a container network ahead of the next networked container.");
                let replaced =
                    PREPARED.lock().unwrap_or_else(|e| e.into_inner()).replace(Prepared { key, docker, net });
                if let Some(old) = replaced {
                    old.net.remove(&old.docker).await;
                }
            }
            Err(e) => tracing::warn!(error = %e, "Could not make a container network ahead: {e}."),
        }
    });
}

/// Remove the namespace made ahead (the daemon's stop), after one being made.
pub async fn release_prepared() {
    let _making = MAKING.lock().await;
    let taken = PREPARED.lock().unwrap_or_else(|e| e.into_inner()).take();
    if let Some(p) = taken {
        p.net.remove(&p.docker).await;
    }
}

/// Wait until no namespace is being made ahead (benchmarks measure warm starts).
pub async fn prepared_settled() {
    let _making = MAKING.lock().await;
}

/// The configurator's shell script (busybox `sh` and `ip`): blocked ranges lead to a
/// table that prohibits everything; with an allow-list, the default route goes and
/// only the allowed ranges are routed. IPv6 rules are set when the namespace has
/// IPv6 at all.
fn configure_script(
    blocked: &[byoc_sandbox::net::Cidr],
    allow: Option<&[byoc_sandbox::net::Cidr]>,
    gateway: std::net::IpAddr,
) -> String {
    let t = PROHIBIT_TABLE;
    let mut s = format!("set -e\nb={NET_BUSYBOX}\n$b ip route add prohibit default table {t}\n");
    for c in blocked.iter().filter(|c| c.is_ipv4()) {
        s.push_str(&format!("$b ip rule add prio 100 to {c} table {t}\n"));
    }
    // A namespace with any IPv6 address gets the IPv6 rules, and a failure to set them
    // fails the job (set -e); only a namespace without IPv6 skips them.
    s.push_str("if $b grep -q . /proc/net/if_inet6 2>/dev/null; then\n");
    s.push_str(&format!("  $b ip -6 route add prohibit default table {t}\n"));
    for c in blocked.iter().filter(|c| !c.is_ipv4()) {
        s.push_str(&format!("  $b ip -6 rule add prio 100 to {c} table {t}\n"));
    }
    s.push_str("fi\n");
    if let Some(allow) = allow {
        s.push_str("$b ip route del default\n$b ip -6 route del default 2>/dev/null || true\n");
        for c in allow.iter().filter(|c| c.is_ipv4()) {
            s.push_str(&format!("$b ip route add {c} via {gateway}\n"));
        }
    }
    s.push_str("echo byoc-network-ready\n");
    s
}

/// A running namespace's extra rules: each range leads to the prohibiting table.
fn close_script(ranges: &[byoc_sandbox::net::Cidr]) -> String {
    let mut s = format!("set -e\nb={NET_BUSYBOX}\n");
    for c in ranges.iter().filter(|c| c.is_ipv4()) {
        s.push_str(&format!("$b ip rule add prio 100 to {c} table {PROHIBIT_TABLE}\n"));
    }
    // As at the start: IPv6 rules wherever the namespace has IPv6.
    s.push_str("if $b grep -q . /proc/net/if_inet6 2>/dev/null; then\n  :\n");
    for c in ranges.iter().filter(|c| !c.is_ipv4()) {
        s.push_str(&format!("  $b ip -6 rule add prio 100 to {c} table {PROHIBIT_TABLE}\n"));
    }
    s.push_str("fi\n");
    s
}

#[cfg(test)]
mod start_tests {
    use super::*;

    fn server_error(status_code: u16, message: &str) -> bollard::errors::Error {
        bollard::errors::Error::DockerResponseServerError { status_code, message: message.into() }
    }

    /// The configurator's script run by a real shell, with a stand-in busybox that
    /// records each `ip` call and fails those that match `fail` (other applets run
    /// as the host's own tools).
    fn run_script(fail: &str) -> (bool, String) {
        let blocked: Vec<byoc_sandbox::net::Cidr> =
            ["169.254.0.0/16", "fd00:ec2::/32"].iter().map(|c| c.parse().unwrap()).collect();
        run(&configure_script(&blocked, None, "172.18.0.1".parse().unwrap()), fail)
    }

    fn run(script: &str, fail: &str) -> (bool, String) {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let calls = dir.path().join("calls");
        let stand_in = dir.path().join("busybox");
        std::fs::write(
            &stand_in,
            format!(
                "#!/bin/sh\n[ \"$1\" = ip ] || exec \"$@\"\necho \"$*\" >> {}\ncase \"$*\" in {fail}) exit 2;; esac\nexit 0\n",
                calls.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&stand_in, std::fs::Permissions::from_mode(0o755)).unwrap();
        let script = script.replace(&format!("b={NET_BUSYBOX}"), &format!("b={}", stand_in.display()));
        let ok = std::process::Command::new("/bin/sh")
            .args(["-c", &script])
            .stdout(std::process::Stdio::null())
            .status()
            .unwrap()
            .success();
        (ok, std::fs::read_to_string(&calls).unwrap_or_default())
    }

    #[test]
    fn a_failed_ipv6_rule_fails_the_configurator_when_the_namespace_has_ipv6() {
        // This host has IPv6 (the suites' machines do): its rules are set...
        // (A file in /proc has no size: the script reads it, as this does.)
        let has_ipv6 = std::fs::read_to_string("/proc/net/if_inet6").is_ok_and(|t| !t.trim().is_empty());
        assert!(has_ipv6, "this test needs a host with IPv6 addresses");
        let (ok, calls) = run_script("__none__");
        assert!(ok, "{calls}");
        assert!(calls.contains("ip -6 rule add prio 100 to fd00:ec2::/32 table 199"), "{calls}");
        // ...and a failure to set one fails the whole script, before it reports ready.
        let (ok, calls) = run_script("ip\\ -6\\ rule*");
        assert!(!ok, "an IPv6 rule failure was ignored:\n{calls}");
        let (ok, _) = run_script("ip\\ -6\\ route\\ add\\ prohibit*");
        assert!(!ok, "an IPv6 table failure was ignored");
    }

    #[test]
    fn ranges_closed_while_a_container_runs_are_each_one_rule_and_a_failure_fails() {
        let v4: Vec<byoc_sandbox::net::Cidr> =
            ["172.30.0.1", "172.30.0.0/16"].iter().map(|c| c.parse().unwrap()).collect();
        let (ok, calls) = run(&close_script(&v4), "__none__");
        assert!(ok, "{calls}");
        assert_eq!(
            calls.lines().collect::<Vec<_>>(),
            [
                "ip rule add prio 100 to 172.30.0.1/32 table 199",
                "ip rule add prio 100 to 172.30.0.0/16 table 199"
            ]
        );
        let v6: Vec<byoc_sandbox::net::Cidr> = vec!["2001:db8:5::1".parse().unwrap()];
        let (ok, calls) = run(&close_script(&v6), "__none__");
        assert!(ok && calls.contains("ip -6 rule add prio 100 to 2001:db8:5::1/128 table 199"), "{calls}");
        let (ok, _) = run(&close_script(&v4), "ip\\ rule*");
        assert!(!ok, "a rule failure was ignored");
    }

    #[test]
    fn only_a_process_runc_could_not_create_is_tried_again() {
        let seen = "failed to create shim task: OCI runtime create failed: runc create failed: unable to start \
                    container process: exec: \"/byoc-net/busybox\": stat /byoc-net/busybox: permission denied: unknown";
        assert!(runc_could_not_create(&server_error(400, seen)));
        assert!(!runc_could_not_create(&server_error(404, "No such container: byoc-job-1-net")));
        assert!(!runc_could_not_create(&server_error(409, "container is already running")));
        assert!(!runc_could_not_create(&bollard::errors::Error::RequestTimeoutError));
    }
}
