//! The files under `deploy/` agree with the server: the Grafana dashboard names only metrics
//! a live server exports, and the example config and the Kubernetes ConfigMap's config load
//! (`--print-config`), with a grace period above the drain timeout. The YAML files are not
//! parsed here (no YAML crate among the dev-dependencies); docs/deploy.md says how they were
//! checked.

use std::collections::{BTreeSet, HashMap};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use orbitkv_testkit::{server_bin, TestServer};
use serde_json::Value;

/// Sample names of the GPU families (server/src/metrics.rs, `gpu_families`), exported only
/// while a GPU is in use, so not in this machine's scrape.
const GPU_SAMPLES: [&str; 10] = [
    "orbitkv_gpu_devices",
    "orbitkv_gpu_registrations",
    "orbitkv_gpu_jobs_total",
    "orbitkv_gpu_bytes_total",
    "orbitkv_gpu_requests_total",
    "orbitkv_gpu_failed_jobs_total",
    "orbitkv_gpu_jobs_in_flight",
    "orbitkv_gpu_jobs_queued",
    "orbitkv_gpu_busy_seconds_total",
    "orbitkv_gpu_threads_lost",
];

/// The repository's `deploy/` folder.
fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// A port free now (bound, then let go).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// The body of `GET path`, which must answer 200 (one request per connection).
fn get(port: u16, path: &str) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .unwrap();
    let mut answer = String::new();
    s.read_to_string(&mut answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").expect("an HTTP answer");
    assert!(head.starts_with("HTTP/1.1 200"), "GET {path}: {head}");
    body.to_string()
}

/// What an exposition exports: each family's type (`# TYPE name type`) and every sample name.
struct Exported {
    families: HashMap<String, String>,
    samples: BTreeSet<String>,
}

impl Exported {
    fn parse(exposition: &str) -> Self {
        let mut families = HashMap::new();
        let mut samples = BTreeSet::new();
        for line in exposition.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').expect("# TYPE name type");
                families.insert(name.to_string(), kind.to_string());
            } else if !line.starts_with('#') && !line.is_empty() {
                let end = line.find(['{', ' ']).unwrap_or(line.len());
                samples.insert(line[..end].to_string());
            }
        }
        Self { families, samples }
    }

    /// Whether a query may name `name`: a sample seen, a gauge, a counter's `_total`, or a
    /// histogram's `_bucket`, `_sum` or `_count` (those have no samples before any request).
    fn has(&self, name: &str) -> bool {
        let of_type = |family: &str, kinds: &[&str]| {
            self.families.get(family).is_some_and(|k| kinds.contains(&k.as_str()))
        };
        self.samples.contains(name)
            || of_type(name, &["gauge"])
            || name.strip_suffix("_total").is_some_and(|f| of_type(f, &["counter"]))
            || ["_bucket", "_sum", "_count"]
                .iter()
                .any(|s| name.strip_suffix(s).is_some_and(|f| of_type(f, &["histogram"])))
    }
}

/// Every `orbitkv_[a-z0-9_]+` word in the strings of `v` (expressions, variable queries,
/// descriptions).
fn metric_names(v: &Value, out: &mut BTreeSet<String>) {
    match v {
        Value::String(s) => {
            let bytes = s.as_bytes();
            let word = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_';
            for (at, _) in s.match_indices("orbitkv_") {
                if at > 0 && word(bytes[at - 1]) {
                    continue;
                }
                let len = bytes[at..].iter().take_while(|&&b| word(b)).count();
                out.insert(s[at..at + len].to_string());
            }
        }
        Value::Array(items) => items.iter().for_each(|x| metric_names(x, out)),
        Value::Object(map) => map.values().for_each(|x| metric_names(x, out)),
        _ => {}
    }
}

#[test]
fn dashboard_names_only_exported_metrics() {
    let path = deploy_dir().join("grafana/orbitkv-dashboard.json");
    let dashboard: Value = serde_json::from_str(&read(&path)).expect("the dashboard is JSON");
    let variables = dashboard["templating"]["list"].as_array().expect("templating variables");
    let variable = |name: &str| variables.iter().find(|v| v["name"] == name);
    assert!(
        variable("DS_PROMETHEUS").is_some_and(|v| v["type"] == "datasource"),
        "no DS_PROMETHEUS datasource variable"
    );
    assert!(variable("instance").is_some(), "no instance variable");
    let mut names = BTreeSet::new();
    metric_names(&dashboard, &mut names);
    for needed in ["orbitkv_op_latency_seconds_bucket", "orbitkv_refusals_total", "orbitkv_ready"] {
        assert!(names.contains(needed), "the dashboard does not use {needed}: {names:?}");
    }

    let ssd = tempfile::tempdir_in("/tmp").unwrap();
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let server = TestServer::start(&[
        "--shards",
        "2",
        "--dram",
        "16MiB",
        "--ssd-dir",
        ssd.path().to_str().unwrap(),
        "--ssd",
        "64MiB",
        "--ssd-region-size",
        "8MiB",
        "--metrics-addr",
        &addr,
    ]);
    let exposition = get(port, "/metrics");
    let exported = Exported::parse(&exposition);
    assert!(exported.families.len() > 20, "a short exposition: {exposition}");
    let unknown: Vec<&String> = names
        .iter()
        .filter(|n| {
            if n.starts_with("orbitkv_gpu_") {
                !GPU_SAMPLES.contains(&n.as_str()) && !exported.has(n)
            } else {
                !exported.has(n)
            }
        })
        .collect();
    assert!(
        unknown.is_empty(),
        "the dashboard names metrics nobody exports: {unknown:?}\n{exposition}"
    );
    drop(server);
}

/// `orbitkv-server --config FILE --print-config`: its output, after asserting exit 0.
fn print_config(file: &Path) -> String {
    let out = Command::new(server_bin())
        .arg("--config")
        .arg(file)
        .arg("--print-config")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{} does not load ({}): {}{stdout}",
        file.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// The image ships the release build the wheel ships: its build stage runs
/// `scripts/release-binaries` and nothing else builds the commands.
#[test]
fn the_image_ships_the_wheels_release_build() {
    let dockerfile = read(&deploy_dir().join("Dockerfile"));
    let runs: Vec<&str> = dockerfile.lines().filter(|l| !l.trim_start().starts_with('#')).collect();
    let text = runs.join("\n");
    assert!(text.contains("scripts/release-binaries /out"), "{dockerfile}");
    assert!(
        !text.contains("cargo build"),
        "a second build recipe in the Dockerfile:\n{dockerfile}"
    );
    assert!(text.contains("COPY --from=build /out/ /usr/local/bin/"), "{dockerfile}");
    let script = read(&deploy_dir().join("../scripts/release-binaries"));
    for bin in ["orbitkv-server", "orbitkv-ctl", "orbitkv-perf"] {
        assert!(
            script.contains(&format!("-p {bin}")),
            "scripts/release-binaries does not build {bin}"
        );
    }
}

#[test]
fn example_config_loads() {
    let printed = print_config(&deploy_dir().join("orbitkv.toml"));
    assert!(printed.contains("metrics-addr = \"127.0.0.1:9464\""), "{printed}");
}

/// The block scalar under `key: |` in `yaml`, de-indented.
fn block_scalar(yaml: &str, key: &str) -> String {
    let mut lines = yaml.lines().skip_while(|l| l.trim() != format!("{key}: |"));
    let head = lines.next().unwrap_or_else(|| panic!("no `{key}: |` block"));
    let key_indent = head.len() - head.trim_start().len();
    let body: Vec<&str> = lines
        .take_while(|l| l.trim().is_empty() || l.len() - l.trim_start().len() > key_indent)
        .collect();
    let indent = body
        .iter()
        .filter(|l| !l.trim().is_empty())
        .map(|l| l.len() - l.trim_start().len())
        .min()
        .expect("a non-empty block");
    body.iter().map(|l| l.get(indent..).unwrap_or("")).collect::<Vec<_>>().join("\n")
}

/// Seconds of a duration as the config prints it (`10s`, `1500ms`, `2m`).
fn seconds(duration: &str) -> f64 {
    let split = duration.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(duration.len());
    let (n, unit) = duration.split_at(split);
    let n: f64 = n.parse().unwrap_or_else(|_| panic!("a duration: {duration}"));
    match unit {
        "ms" => n / 1000.0,
        "s" | "" => n,
        "m" => n * 60.0,
        other => panic!("unit {other:?} of {duration}"),
    }
}

/// The value of the first `key: value` line in `text` (quotes removed).
fn value_of<'a>(text: &'a str, key: &str, separator: &str) -> &'a str {
    text.lines()
        .map(str::trim)
        .find_map(|l| l.strip_prefix(key)?.trim_start().strip_prefix(separator))
        .unwrap_or_else(|| panic!("no {key} in {text}"))
        .trim()
        .trim_matches('"')
}

#[test]
fn kubernetes_config_loads_and_outlives_the_drain() {
    let daemonset = read(&deploy_dir().join("k8s/daemonset.yaml"));
    let toml = block_scalar(&daemonset, "orbitkv.toml");
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let file = dir.path().join("orbitkv.toml");
    std::fs::write(&file, &toml).unwrap();
    let printed = print_config(&file);
    assert!(printed.contains("metrics-addr = \"0.0.0.0:9464\""), "{printed}");
    assert!(printed.contains("socket = \"/run/orbitkv/orbitkv.sock\""), "{printed}");

    let drain = seconds(value_of(&printed, "drain-timeout", "="));
    let grace: f64 = value_of(&daemonset, "terminationGracePeriodSeconds", ":").parse().unwrap();
    assert!(grace > drain, "terminationGracePeriodSeconds {grace} <= drain-timeout {drain}s");

    // The probes and the Service reach the listener the config binds.
    for probe in ["path: /readyz", "path: /healthz", "containerPort: 9464"] {
        assert!(daemonset.contains(probe), "the DaemonSet has no `{probe}`");
    }
    let service = read(&deploy_dir().join("k8s/service.yaml"));
    assert!(service.contains("port: 9464"), "{service}");
}

/// The `- --flag=value` items of the first `command:` list under `service:` in a compose file,
/// with `${VAR:-default}` replaced by its default.
fn compose_command(yaml: &str, service: &str) -> Vec<String> {
    let mut lines = yaml.lines().skip_while(|l| l.trim() != format!("{service}:"));
    lines.next().unwrap_or_else(|| panic!("no service {service}"));
    lines
        .skip_while(|l| l.trim() != "command:")
        .skip(1)
        .take_while(|l| l.trim_start().starts_with("- "))
        .map(|l| {
            let item = l.trim_start().trim_start_matches("- ").to_string();
            match (item.find("${"), item.find(":-"), item.find('}')) {
                (Some(a), Some(d), Some(z)) if a < d && d < z => {
                    format!("{}{}{}", &item[..a], &item[d + 2..z], &item[z + 1..])
                }
                _ => item,
            }
        })
        .collect()
}

#[test]
fn compose_commands_are_flags_the_server_takes() {
    for (file, cluster) in [("compose.yaml", false), ("compose.cluster.yaml", true)] {
        let yaml = read(&deploy_dir().join(file));
        let flags = compose_command(&yaml, "orbitkv-server");
        assert!(flags.len() >= 4, "{file}: {flags:?}");
        assert_eq!(flags.iter().any(|f| f.starts_with("--etcd=")), cluster, "{file}: {flags:?}");
        // The config file as the container mounts it: the repository's example.
        let flags: Vec<String> = flags
            .into_iter()
            .map(|f| match f.strip_prefix("--config=") {
                Some(_) => format!("--config={}", deploy_dir().join("orbitkv.toml").display()),
                None => f,
            })
            .collect();
        let out = Command::new(server_bin()).args(&flags).arg("--print-config").output().unwrap();
        assert!(
            out.status.success(),
            "{file}: {flags:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let printed = String::from_utf8_lossy(&out.stdout);
        assert_eq!(printed.contains("etcd = [\"http://etcd:2379\"]"), cluster, "{printed}");
    }
}
