//! `byoc-bench-sync`: `skopeo copy` against `byoc-runner sync` between the same two
//! local registries (Debian's docker-registry), in one run. Figures, not assertions:
//! cold copy of an image of incompressible layers, re-copy when everything exists
//! (median of N runs each), and our copier's peak RSS during a 1 GiB copy (GNU time).

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use byoc_control_plane::registry::{LocalRegistry, OCI_CONFIG, OCI_LAYER, Pushed, digest_of, fill_random};
use clap::Parser;

#[derive(Parser)]
#[command(name = "byoc-bench-sync", about = "skopeo copy vs byoc-runner sync, same registries, one run")]
struct Args {
    #[arg(long)]
    runner_bin: Option<PathBuf>,
    #[arg(long, default_value = "skopeo")]
    skopeo: PathBuf,
    /// Size of the benchmark image, MiB (split evenly over --layers).
    #[arg(long, default_value_t = 256)]
    image_mib: usize,
    #[arg(long, default_value_t = 8)]
    layers: usize,
    /// Size of the image for the peak-RSS figure, MiB (0 skips it).
    #[arg(long, default_value_t = 1024)]
    rss_mib: usize,
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Image shapes to compare, each against skopeo in this run: LAYERSxMIB, comma
    /// separated (`--shapes 1x200,4x50,8x32,64x1`); replaces --image-mib/--layers.
    #[arg(long, value_delimiter = ',')]
    shapes: Vec<String>,
}

/// The cold-copy target for every shape.
const COLD_TARGET: f64 = 1.5;

async fn push_image(reg: &LocalRegistry, repo: &str, mib: usize, layers: usize, seed: u64) -> Pushed {
    let per = (mib << 20) / layers;
    let mut ls = Vec::new();
    for i in 0..layers {
        let mut buf = vec![0u8; per];
        fill_random(&mut buf, seed * 100 + i as u64);
        let digest = digest_of(&buf);
        reg.push_blob(repo, buf, &digest, per as u64).await;
        ls.push(Pushed { digest, media_type: OCI_LAYER.into(), bytes: vec![], size: per as u64 });
    }
    let config = reg
        .push_bytes(
            repo,
            OCI_CONFIG,
            format!(r#"{{"architecture":"amd64","os":"linux","seed":{seed}}}"#).into_bytes(),
        )
        .await;
    reg.push_image(repo, Some("1"), config, &ls, None, None).await
}

fn timed(cmd: &mut Command) -> anyhow::Result<Duration> {
    let t = Instant::now();
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    ensure!(
        out.status.success(),
        "{cmd:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(t.elapsed())
}

fn skopeo(a: &Args, src: &str, dst: &str) -> Command {
    let mut c = Command::new(&a.skopeo);
    c.args(["--insecure-policy", "copy", "--src-tls-verify=false", "--dest-tls-verify=false", "-q"])
        .arg(format!("docker://{src}"))
        .arg(format!("docker://{dst}"));
    c
}

fn ours(bin: &PathBuf, src: &str, dst: &str) -> Command {
    let mut c = Command::new(bin);
    c.args(["sync", "-o", "json", src, dst]);
    c
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let bin = a
        .runner_bin
        .clone()
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/release/byoc-runner"));
    ensure!(bin.exists(), "{} not found: cargo build --release -p byoc-runner", bin.display());
    let src = LocalRegistry::start(None).await;

    // Peak RSS through GNU time: a child forked from this process would count this
    // process's own pages (the pushed layers) in its high-water mark until it execs.
    if a.rss_mib > 0 {
        push_image(&src, "bench/big", a.rss_mib, 4, 99).await;
        let dst = LocalRegistry::start(None).await;
        let mut c = Command::new("/usr/bin/time");
        c.args(["-f", "maxrss_kib=%M"]).arg(&bin).args([
            "sync",
            "-o",
            "json",
            &format!("{}/bench/big:1", src.host()),
            &format!("{}/bench/big:1", dst.host()),
        ]);
        let t = Instant::now();
        let out = c.output().context("running /usr/bin/time (Debian package time)")?;
        let d = t.elapsed();
        ensure!(out.status.success(), "sync failed: {}", String::from_utf8_lossy(&out.stderr));
        let stderr = String::from_utf8_lossy(&out.stderr);
        let kib: f64 = stderr
            .lines()
            .find_map(|l| l.strip_prefix("maxrss_kib="))
            .and_then(|v| v.trim().parse().ok())
            .context("no maxrss from /usr/bin/time")?;
        println!(
            "peak RSS of byoc-runner sync copying {} MiB in 4 layers: {:.1} MiB ({:.2} s, target ≤ 64 MB)",
            a.rss_mib,
            kib / 1024.0,
            d.as_secs_f64()
        );
    }

    let shapes: Vec<(usize, usize)> = if a.shapes.is_empty() {
        vec![(a.layers, a.image_mib / a.layers.max(1))]
    } else {
        a.shapes
            .iter()
            .map(|s| {
                let (l, m) = s.split_once('x').with_context(|| format!("shape {s:?}: LAYERSxMIB"))?;
                Ok((l.parse()?, m.parse()?))
            })
            .collect::<anyhow::Result<_>>()?
    };
    let mut summary = Vec::new();
    for (i, (layers, per_mib)) in shapes.iter().copied().enumerate() {
        let ratio = compare(&a, &bin, &src, layers, per_mib, 7 + i as u64).await?;
        summary.push(format!("{layers} x {per_mib} MiB: {ratio:.2}x"));
    }
    if summary.len() > 1 {
        println!("cold throughput ratio by shape (target >= {COLD_TARGET}x each): {}", summary.join(", "));
    }
    Ok(())
}

/// Cold and warm copies of one image shape by both tools, fresh destinations each run,
/// the order alternating; prints the medians. The cold throughput ratio.
async fn compare(
    a: &Args,
    bin: &PathBuf,
    src: &LocalRegistry,
    layers: usize,
    per_mib: usize,
    seed: u64,
) -> anyhow::Result<f64> {
    let repo = format!("bench/img{layers}x{per_mib}");
    let img = push_image(src, &repo, layers * per_mib, layers, seed).await;
    println!("image: {layers} layers of {per_mib} MiB of incompressible data, {}", img.digest);
    let from = format!("{}/{repo}:1", src.host());
    let (mut sk_cold, mut sk_warm, mut our_cold, mut our_warm) = (vec![], vec![], vec![], vec![]);
    for run in 0..a.runs {
        // Fresh destinations each run; who goes first alternates.
        let (d1, d2) = tokio::join!(LocalRegistry::start(None), LocalRegistry::start(None));
        let to_sk = format!("{}/{repo}:1", d1.host());
        let to_ours = format!("{}/{repo}:1", d2.host());
        let mut measure_skopeo = || -> anyhow::Result<()> {
            sk_cold.push(timed(&mut skopeo(a, &from, &to_sk))?);
            sk_warm.push(timed(&mut skopeo(a, &from, &to_sk))?);
            Ok(())
        };
        let mut measure_ours = || -> anyhow::Result<()> {
            our_cold.push(timed(&mut ours(bin, &from, &to_ours))?);
            our_warm.push(timed(&mut ours(bin, &from, &to_ours))?);
            Ok(())
        };
        if run % 2 == 0 {
            measure_skopeo()?;
            measure_ours()?;
        } else {
            measure_ours()?;
            measure_skopeo()?;
        }
        println!(
            "run {}: skopeo cold {:.2} s warm {:.3} s | byoc-runner sync cold {:.2} s warm {:.3} s",
            run + 1,
            sk_cold[run].as_secs_f64(),
            sk_warm[run].as_secs_f64(),
            our_cold[run].as_secs_f64(),
            our_warm[run].as_secs_f64()
        );
    }
    let mib = (layers * per_mib) as f64;
    let (sc, sw, oc, ow) = (median(sk_cold), median(sk_warm), median(our_cold), median(our_warm));
    println!(
        "median of {}: cold skopeo {:.1} MiB/s, byoc-runner {:.1} MiB/s → throughput ratio {:.2}× (target ≥ {COLD_TARGET}×)",
        a.runs,
        mib / sc.as_secs_f64(),
        mib / oc.as_secs_f64(),
        sc.as_secs_f64() / oc.as_secs_f64()
    );
    println!(
        "median of {}: warm re-copy skopeo {:.3} s, byoc-runner {:.3} s → time ratio {:.2}× (target ≤ 0.5×)",
        a.runs,
        sw.as_secs_f64(),
        ow.as_secs_f64(),
        ow.as_secs_f64() / sw.as_secs_f64()
    );
    Ok(sc.as_secs_f64() / oc.as_secs_f64())
}
