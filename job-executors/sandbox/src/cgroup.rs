//! Per-job cgroups: memory, pids and CPU limits, and a way to kill everything a job
//! left behind. Customer VMs use cgroup v2; the build machines here have a hybrid v1
//! layout with the v1 memory and pids controllers. Both are supported; which one was
//! used (or why none could be) is written to the job log by the executor.
//!
//! The runner (not the helper) creates and removes the cgroup, so a job that dies in
//! any way still has its cgroup cleaned up.

use std::path::{Path, PathBuf};

const ROOT: &str = "/sys/fs/cgroup";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub memory_bytes: u64,
    pub pids: u64,
    /// CPU quota in thousandths of a CPU (1000 = one full core).
    pub cpu_millis: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    V1,
    V2,
}

#[derive(Debug)]
pub struct JobCgroup {
    pub version: Version,
    /// One directory per controller hierarchy (v1) or a single one (v2).
    dirs: Vec<PathBuf>,
    /// `cgroup.procs` files a process writes its pid to, to join.
    pub procs: Vec<PathBuf>,
    pub limits: Limits,
    /// What was applied, for the job log.
    pub applied: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("no usable cgroup hierarchy: {0}")]
    Unavailable(String),
    #[error("{op} {path}: {source}")]
    Io { op: &'static str, path: PathBuf, source: std::io::Error },
}

fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> CgroupError + 'a {
    move |source| CgroupError::Io { op, path: path.to_path_buf(), source }
}

/// This process's cgroup path in a hierarchy: the v2 line `0::/path`, or the v1 line
/// whose controller list contains `controller`.
fn own_path(controller: Option<&str>) -> Option<String> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    text.lines().find_map(|line| {
        let mut parts = line.splitn(3, ':');
        let (id, ctrls, path) = (parts.next()?, parts.next()?, parts.next()?);
        match controller {
            None if id == "0" && ctrls.is_empty() => Some(path.to_string()),
            Some(c) if ctrls.split(',').any(|x| x == c) => Some(path.to_string()),
            _ => None,
        }
    })
}

pub fn detect() -> Option<Version> {
    let v2_controllers = std::fs::read_to_string(Path::new(ROOT).join("cgroup.controllers")).ok();
    if v2_controllers.is_some_and(|c| c.split_whitespace().any(|x| x == "memory")) {
        return Some(Version::V2);
    }
    if Path::new(ROOT).join("memory").join("memory.limit_in_bytes").exists() {
        return Some(Version::V1);
    }
    None
}

impl JobCgroup {
    /// Create `byoc-job-<id>` under the runner's own cgroup, with limits applied.
    pub fn create(job_id: &str, limits: Limits) -> Result<JobCgroup, CgroupError> {
        match detect() {
            Some(Version::V2) => Self::create_v2(job_id, limits),
            Some(Version::V1) => Self::create_v1(job_id, limits),
            None => Err(CgroupError::Unavailable(
                "neither cgroup v2 with the memory controller nor v1 memory/pids hierarchies are mounted"
                    .into(),
            )),
        }
    }

    fn create_v1(job_id: &str, limits: Limits) -> Result<JobCgroup, CgroupError> {
        let name = format!("byoc-job-{job_id}");
        let mut cg = JobCgroup { version: Version::V1, dirs: vec![], procs: vec![], limits, applied: vec![] };
        for controller in ["memory", "pids", "cpu"] {
            let own = own_path(Some(controller)).unwrap_or_else(|| "/".into());
            let base = Path::new(ROOT).join(controller).join(own.trim_start_matches('/'));
            if !base.exists() {
                if controller == "cpu" {
                    continue;
                }
                return Err(CgroupError::Unavailable(format!("{} is missing", base.display())));
            }
            let dir = base.join(&name);
            match std::fs::create_dir(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => {
                    // Undo what was created so far.
                    cg.remove();
                    return Err(io("creating", &dir)(e));
                }
            }
            cg.dirs.push(dir.clone());
            cg.procs.push(dir.join("cgroup.procs"));
            let set = |file: &str, value: String| {
                let p = dir.join(file);
                std::fs::write(&p, value).map_err(io("writing", &p))
            };
            let result = match controller {
                "memory" => set("memory.limit_in_bytes", limits.memory_bytes.to_string())
                    .map(|()| format!("memory {} MiB", limits.memory_bytes / (1024 * 1024))),
                "pids" => set("pids.max", limits.pids.to_string()).map(|()| format!("pids {}", limits.pids)),
                _ => set("cpu.cfs_period_us", "100000".into())
                    .and_then(|()| set("cpu.cfs_quota_us", (limits.cpu_millis * 100).to_string()))
                    .map(|()| format!("cpu {:.2} cores", limits.cpu_millis as f64 / 1000.0)),
            };
            match result {
                Ok(s) => cg.applied.push(s),
                Err(e) => {
                    cg.remove();
                    return Err(e);
                }
            }
        }
        Ok(cg)
    }

    fn create_v2(job_id: &str, limits: Limits) -> Result<JobCgroup, CgroupError> {
        // Under systemd (Delegate=yes) the runner owns its unit's cgroup. A cgroup with
        // processes cannot hand controllers to children ("no internal processes"), so
        // the runner first moves itself into `<own>/supervisor`, then jobs go under
        // `<own>/byoc-jobs/job-<id>` with memory, pids and cpu enabled.
        let own = own_path(None).unwrap_or_else(|| "/".into());
        let base = Path::new(ROOT).join(own.trim_start_matches('/'));
        let jobs = base.join("byoc-jobs");
        if !jobs.exists() {
            if own != "/" {
                let supervisor = base.join("supervisor");
                if !supervisor.exists() {
                    std::fs::create_dir(&supervisor).map_err(io("creating", &supervisor))?;
                }
                let procs = std::fs::read_to_string(base.join("cgroup.procs")).unwrap_or_default();
                let target = supervisor.join("cgroup.procs");
                for pid in procs.split_whitespace() {
                    std::fs::write(&target, pid).map_err(io("moving the runner into", &target))?;
                }
                let ctl = base.join("cgroup.subtree_control");
                std::fs::write(&ctl, "+memory +pids +cpu").map_err(io("enabling controllers in", &ctl))?;
            }
            std::fs::create_dir(&jobs).map_err(io("creating", &jobs))?;
        }
        let subtree = jobs.join("cgroup.subtree_control");
        std::fs::write(&subtree, "+memory +pids +cpu").map_err(io("enabling controllers in", &subtree))?;
        let dir = jobs.join(format!("job-{job_id}"));
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io("creating", &dir)(e)),
        }
        let mut cg = JobCgroup {
            version: Version::V2,
            dirs: vec![dir.clone()],
            procs: vec![dir.join("cgroup.procs")],
            limits,
            applied: vec![],
        };
        let set = |file: &str, value: String| {
            let p = dir.join(file);
            std::fs::write(&p, value).map_err(io("writing", &p))
        };
        let r = set("memory.max", limits.memory_bytes.to_string())
            .and_then(|()| set("memory.swap.max", "0".into()).or(Ok(())))
            .and_then(|()| set("pids.max", limits.pids.to_string()))
            .and_then(|()| set("cpu.max", format!("{} 100000", limits.cpu_millis * 100)));
        if let Err(e) = r {
            cg.remove();
            return Err(e);
        }
        cg.applied = vec![
            format!("memory {} MiB", limits.memory_bytes / (1024 * 1024)),
            format!("pids {}", limits.pids),
            format!("cpu {:.2} cores", limits.cpu_millis as f64 / 1000.0),
        ];
        Ok(cg)
    }

    /// The job's directory on a v2 hierarchy (where its init is born), `None` on v1.
    pub fn v2_dir(&self) -> Option<&Path> {
        (self.version == Version::V2).then(|| self.dirs[0].as_path())
    }

    /// Did the kernel kill something in this cgroup for exceeding the memory limit?
    pub fn oom_killed(&self) -> bool {
        let dir = &self.dirs[0];
        let text = match self.version {
            Version::V2 => std::fs::read_to_string(dir.join("memory.events")),
            Version::V1 => std::fs::read_to_string(dir.join("memory.oom_control")),
        }
        .unwrap_or_default();
        counter(&text, "oom_kill") > 0
    }

    /// Was a fork refused because of the pids limit?
    pub fn pids_limited(&self) -> bool {
        let dir = match self.version {
            Version::V2 => &self.dirs[0],
            Version::V1 => match self.dirs.iter().find(|d| d.join("pids.events").exists()) {
                Some(d) => d,
                None => return false,
            },
        };
        counter(&std::fs::read_to_string(dir.join("pids.events")).unwrap_or_default(), "max") > 0
    }

    /// Send SIGKILL to every process in the cgroup now (one pass, no waiting); whether
    /// there was any.
    pub fn kill_all(&self) -> bool {
        let mut any = false;
        for procs in &self.procs {
            for pid in std::fs::read_to_string(procs).unwrap_or_default().split_whitespace() {
                if let Ok(pid) = pid.parse::<i32>() {
                    any = true;
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(pid),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                }
            }
        }
        any
    }

    /// Kill every process still in the cgroup (bounded retries) and remove it.
    pub fn kill_all_and_remove(&self) {
        for _ in 0..100 {
            if !self.kill_all() {
                break;
            }
            std::thread::yield_now();
        }
        self.remove();
    }

    fn remove(&self) {
        for d in self.dirs.iter().rev() {
            // Removal fails while the kernel still finishes tearing processes down;
            // a few attempts cover that.
            for _ in 0..100 {
                match std::fs::remove_dir(d) {
                    Ok(()) => break,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                    Err(_) => std::thread::sleep(std::time::Duration::from_millis(5)),
                }
            }
        }
    }
}

fn counter(text: &str, key: &str) -> u64 {
    text.lines()
        .find_map(|l| {
            let mut it = l.split_whitespace();
            (it.next() == Some(key)).then(|| it.next().and_then(|v| v.parse().ok())).flatten()
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_parse() {
        assert_eq!(counter("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n", "oom_kill"), 2);
        assert_eq!(counter("max 0\n", "max"), 0);
        assert_eq!(counter("", "max"), 0);
    }
}
