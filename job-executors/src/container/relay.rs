//! A container's output through a pipe of the runner's own.
//!
//! The engine's attach stream carries a container's output at about 100 MB/s on a
//! 2-core machine (dockerd copies it from the shim's pipes into an HTTP stream), a
//! third of what a sandboxed process's pipe gives. So the container's first process is
//! a static busybox mounted read-only that sends its stdout and stderr into a FIFO the
//! runner made and reads, then executes the job's command in its place: the command
//! is the container's PID 1 as before, with the same argv, environment, user and
//! limits. The FIFO gives the container nothing it did not have (it is its own
//! output); the runner holds a writer of its own until the engine says the container
//! stopped, so that the read ends exactly when every byte it wrote has been read.

use std::os::unix::fs::{DirBuilderExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

use tokio::net::unix::pipe;

/// Where the relay's busybox and the FIFO appear in the container.
const BUSYBOX: &str = "/byoc-out/busybox";
const FIFO: &str = "/byoc-out/log";

/// The container's first command: output to the FIFO (the shell's own errors too),
/// then the job's command found on the container's PATH as runc would find it. The
/// lookup is written out because busybox's shell would run its own applet of the
/// same name instead of the image's program.
const SCRIPT: &str = r#"exec >/byoc-out/log 2>&1
p="$0"
case "$p" in
*/*) ;;
*)
  found=
  IFS=:
  for d in ${PATH:-/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin}; do
    if [ -n "$d" ] && [ -f "$d/$p" ] && [ -x "$d/$p" ]; then found="$d/$p"; break; fi
  done
  unset IFS
  if [ -z "$found" ]; then echo "byoc-runner: $p: executable file not found in \$PATH" >&2; exit 127; fi
  p="$found"
  ;;
esac
"#;

/// Variables busybox's shell sets at its start (`PATH` only when missing, which the
/// engine never leaves it): set back to what the engine gave the container.
const SHELL_SETS: [&str; 2] = ["PWD", "SHLVL"];

/// Bytes read from the FIFO at once.
pub(super) const READ_CHUNK: usize = 64 * 1024;

/// The FIFO the container writes its output into, read by the runner.
pub(super) struct Relay {
    pub(super) dir: PrivateDir,
    pub(super) reader: pipe::Receiver,
    /// The runner's own writer: without one, a read before the container opens the
    /// FIFO would end at once. Dropped when the container has stopped, so that the
    /// read ends once what it wrote is read.
    pub(super) holder: Option<pipe::Sender>,
}

impl Relay {
    /// A FIFO in a new private directory under `parent`, writable by `uid:gid` only
    /// (when the runner can hand it over), opened for reading.
    pub(super) fn open(parent: &Path, uid: u32, gid: u32) -> std::io::Result<Relay> {
        let dir = PrivateDir::create(parent)?;
        let path = dir.0.join("log");
        nix::unistd::mkfifo(&path, nix::sys::stat::Mode::from_bits_truncate(0o600))?;
        if nix::unistd::geteuid().is_root() {
            std::os::unix::fs::chown(&path, Some(uid), Some(gid))?;
        } else {
            // The container's user is not ours to hand it to; the directory stays private.
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666))?;
        }
        let reader = pipe::OpenOptions::new().open_receiver(&path)?;
        let holder = Some(pipe::OpenOptions::new().open_sender(&path)?);
        Ok(Relay { dir, reader, holder })
    }

    /// The container's mounts: the busybox read-only, the FIFO.
    pub(super) fn binds(&self, busybox: &Path) -> [String; 2] {
        [
            format!("{}:{BUSYBOX}:ro", busybox.display()),
            format!("{}:{FIFO}:rw", self.dir.0.join("log").display()),
        ]
    }
}

/// A directory only the runner can enter, removed with what is in it when dropped.
pub(super) struct PrivateDir(PathBuf);

/// The prefix of the relays' directories beside the jobs' working directories.
const DIR_PREFIX: &str = ".container-output-";

/// Remove every relay directory under `parent` (none is in use: no job runs).
pub(super) fn remove_left(parent: &Path) {
    let Ok(entries) = std::fs::read_dir(parent) else { return };
    for e in entries.flatten() {
        if e.file_name().to_string_lossy().starts_with(DIR_PREFIX) {
            tracing::warn!(path = %e.path().display(), "Removing a container output pipe left by an interrupted job.");
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

impl PrivateDir {
    fn create(parent: &Path) -> std::io::Result<PrivateDir> {
        let path = parent.join(format!("{DIR_PREFIX}{}", byoc_protocol::random_hex(8)));
        std::fs::DirBuilder::new().mode(0o700).create(&path)?;
        Ok(PrivateDir(path))
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The entrypoint and command that run `argv` behind the relay, with the environment
/// the engine makes of the image's (`image_env`) and the job's (`env`, winning).
pub(super) fn wrapped(argv: Vec<String>, image_env: &[String], env: &[String]) -> (Vec<String>, Vec<String>) {
    let mut script = SCRIPT.to_string();
    for name in SHELL_SETS {
        let given = env
            .iter()
            .chain(image_env)
            .find_map(|kv| kv.split_once('=').filter(|(k, _)| *k == name).map(|(_, v)| v));
        script.push_str(&match given {
            Some(v) => format!("export {name}='{}'\n", v.replace('\'', r"'\''")),
            None => format!("unset {name}\n"),
        });
    }
    script.push_str("exec \"$p\" \"$@\"\n");
    (vec![BUSYBOX.into(), "sh".into(), "-c".into(), script], argv)
}

/// What the engine would run: the job's entrypoint and command over the image's, by
/// the engine's rule (an entrypoint given by the job drops the image's command; an
/// empty one drops the image's entrypoint).
pub(super) fn argv(
    entrypoint: Option<&[String]>,
    command: &[String],
    image: Option<&bollard::models::ImageConfig>,
) -> Result<Vec<String>, String> {
    let image_entrypoint = image.and_then(|c| c.entrypoint.clone()).unwrap_or_default();
    let image_cmd = image.and_then(|c| c.cmd.clone()).unwrap_or_default();
    let argv: Vec<String> = match entrypoint {
        Some(e) if !e.is_empty() => e.iter().chain(command).cloned().collect(),
        Some(_) => {
            if command.is_empty() {
                image_cmd
            } else {
                command.to_vec()
            }
        }
        None => {
            let cmd = if command.is_empty() { image_cmd } else { command.to_vec() };
            image_entrypoint.into_iter().chain(cmd).collect()
        }
    };
    if argv.first().is_none_or(|p| p.is_empty()) {
        return Err("the image has no entrypoint or command and the job gives none".into());
    }
    Ok(argv)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &[&str]) -> Vec<String> {
        s.iter().map(|x| x.to_string()).collect()
    }

    #[tokio::test]
    async fn a_relay_makes_a_private_fifo_and_left_ones_are_removed() {
        let parent = tempfile::tempdir().unwrap();
        let job = parent.path().join("job-1");
        std::fs::create_dir(&job).unwrap();
        let relay = Relay::open(parent.path(), 65534, 65534).unwrap();
        let dir = relay.dir.0.clone();
        use std::os::unix::fs::FileTypeExt as _;
        assert!(std::fs::metadata(dir.join("log")).unwrap().file_type().is_fifo());
        assert_eq!(std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777, 0o700);
        // A runner killed while the job ran leaves it; the next start removes it, and
        // nothing else.
        std::mem::forget(relay);
        remove_left(parent.path());
        assert!(!dir.exists());
        assert!(job.exists());
        // Dropped, it goes.
        let relay = Relay::open(parent.path(), 65534, 65534).unwrap();
        let dir = relay.dir.0.clone();
        drop(relay);
        assert!(!dir.exists());
    }

    #[test]
    fn argv_follows_the_engines_rule() {
        let image = bollard::models::ImageConfig {
            entrypoint: Some(v(&["/entry", "-x"])),
            cmd: Some(v(&["serve"])),
            ..Default::default()
        };
        let i = Some(&image);
        assert_eq!(argv(None, &[], i).unwrap(), v(&["/entry", "-x", "serve"]));
        assert_eq!(argv(None, &v(&["migrate"]), i).unwrap(), v(&["/entry", "-x", "migrate"]));
        assert_eq!(argv(Some(&v(&["sh"])), &[], i).unwrap(), v(&["sh"]));
        assert_eq!(argv(Some(&v(&["sh"])), &v(&["-c", "true"]), i).unwrap(), v(&["sh", "-c", "true"]));
        assert_eq!(argv(Some(&[]), &[], i).unwrap(), v(&["serve"]));
        assert_eq!(argv(Some(&[]), &v(&["seq", "3"]), i).unwrap(), v(&["seq", "3"]));
        let bare = bollard::models::ImageConfig::default();
        assert!(argv(None, &[], Some(&bare)).is_err());
        assert!(argv(None, &[], None).is_err());
        assert!(argv(Some(&[]), &[String::new()], None).is_err());
    }

    #[test]
    fn the_script_runs_the_programme_on_path_not_busyboxs_applet() {
        let Some(busybox) = ["/bin/busybox", "/usr/bin/busybox"].into_iter().find(|p| Path::new(p).exists())
        else {
            panic!("busybox is not installed (apt-get install busybox-static)");
        };
        let dir = tempfile::tempdir().unwrap();
        // A `seq` of the image's own that is not busybox's.
        let bin = dir.path().join("bin");
        std::fs::create_dir(&bin).unwrap();
        std::fs::write(bin.join("seq"), "#!/bin/sh\necho image-seq \"$@\"\n").unwrap();
        std::fs::set_permissions(bin.join("seq"), std::fs::Permissions::from_mode(0o755)).unwrap();
        let out = dir.path().join("out").display().to_string();
        let run = |prog: &str, path: &str| {
            let (entrypoint, cmd) = wrapped(v(&[prog, "1", "2"]), &[], &[]);
            let script = entrypoint[3].replace("/byoc-out/log", &out);
            let status = std::process::Command::new(busybox)
                .args(["sh", "-c", &script])
                .args(cmd)
                .env_clear()
                .env("PATH", path)
                .status()
                .unwrap();
            (status.code(), std::fs::read_to_string(dir.path().join("out")).unwrap())
        };
        let path = format!("/nonexistent::{}", bin.display());
        assert_eq!(run("seq", &path), (Some(0), "image-seq 1 2\n".into()));
        let (code, out) = run("no-such-tool", &path);
        assert_eq!(code, Some(127));
        assert!(out.contains("no-such-tool: executable file not found"), "{out}");
        // A path is run as given.
        let (code, out) = run(&bin.join("seq").display().to_string(), "/nonexistent");
        assert_eq!((code, out.as_str()), (Some(0), "image-seq 1 2\n"));
    }

    /// The command gets the environment the engine made, not the shell's additions.
    #[test]
    fn the_command_gets_the_engines_environment() {
        let busybox = ["/bin/busybox", "/usr/bin/busybox"]
            .into_iter()
            .find(|p| Path::new(p).exists())
            .expect("busybox is not installed (apt-get install busybox-static)");
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        let env_of = |image_env: &[String], env: &[(&str, &str)]| {
            let job_env: Vec<String> = env.iter().map(|(k, v)| format!("{k}={v}")).collect();
            let (entrypoint, cmd) = wrapped(v(&["/usr/bin/env"]), image_env, &job_env);
            let script = entrypoint[3].replace("/byoc-out/log", &out.display().to_string());
            let status = std::process::Command::new(busybox)
                .args(["sh", "-c", &script])
                .args(cmd)
                .env_clear()
                .envs(env.iter().copied())
                .current_dir(dir.path())
                .status()
                .unwrap();
            assert!(status.success());
            let mut seen: Vec<String> =
                std::fs::read_to_string(&out).unwrap().lines().map(String::from).collect();
            seen.sort();
            seen
        };
        assert_eq!(env_of(&[], &[("PATH", "/bin"), ("A", "1")]), v(&["A=1", "PATH=/bin"]));
        let quoted = "it's $HOME";
        assert_eq!(
            env_of(&v(&["SHLVL=7"]), &[("PATH", "/bin"), ("SHLVL", "7"), ("PWD", quoted)]),
            v(&["PATH=/bin", &format!("PWD={quoted}"), "SHLVL=7"])
        );
    }
}
