use super::*;

fn with(edit: impl FnOnce(&mut ServerConfig)) -> ServerConfig {
    let mut c = ServerConfig::default();
    edit(&mut c);
    c
}

fn bad(c: ServerConfig) -> String {
    c.validate().unwrap_err().to_string()
}

fn flags(argv: &[&str]) -> Result<ServerConfig, String> {
    let argv = std::iter::once("orbitkv-server").chain(argv.iter().copied());
    from_command_line(argv).map(|(c, _)| c).map_err(|e| e.to_string())
}

#[test]
fn defaults_validate() {
    let s = ServerConfig::default().validate().unwrap();
    assert!(s.shards >= 1);
    assert_eq!(s.max_chunk_bytes, 256 << 20);
    let d = ServerConfig::default();
    assert_eq!(d.dram, ByteSize(1 << 30));
    assert!(d.lock_arena && d.pin && !d.gpu_timeline);
    assert_eq!(
        (d.gpu, d.gpu_copy, d.gpu_checksums),
        (GpuMode::Auto, Strategy::Auto, ChecksumPlace::Fused)
    );
    assert_eq!(d.gpu_job.bytes(), JOB_BYTES);
}

/// Every option's doc comment ends with its default, and that text is the default clap
/// (and so `Default` and serde) uses: the help cannot drift from the code.
#[test]
fn every_option_states_its_real_default() {
    let cmd = Args::command();
    let d = toml::Table::try_from(ServerConfig::default()).unwrap();
    let mut checked = 0;
    for arg in cmd.get_arguments() {
        let id = arg.get_id().as_str();
        if matches!(id, "config" | "print_config" | "help" | "version") {
            continue;
        }
        let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
        let stated = help
            .rsplit_once("Default: ")
            .map(|(_, s)| s.trim_end_matches('.').to_string())
            .unwrap_or_else(|| panic!("--{id}: its help does not end with its default: {help}"));
        let key = id.replace('_', "-");
        match d.get(&key) {
            // Options without a value by default (socket, ssd-dir, staging depth) say what
            // the server does instead; lists are empty.
            None => assert!(!stated.is_empty(), "--{id}"),
            Some(toml::Value::Array(a)) => assert!(a.is_empty() && stated == "none", "--{id}"),
            Some(toml::Value::String(s)) => assert_eq!(&stated, s, "--{id}"),
            Some(v) => assert_eq!(stated, v.to_string(), "--{id}"),
        }
        checked += 1;
    }
    assert!(checked >= 25, "{checked} options checked");
}

#[test]
fn errors_name_the_flag() {
    assert!(bad(with(|c| c.dram = ByteSize(4 << 10))).contains("--dram"));
    assert!(bad(with(|c| c.max_sessions = 0)).contains("--max-sessions"));
    assert!(bad(with(|c| c.idle_poll_max = "1s".parse().unwrap())).contains("--idle-poll-max"));
    assert!(bad(with(|c| c.spin_window = "1s".parse().unwrap())).contains("--spin-window"));
    assert!(bad(with(|c| c.gpu_staging = ByteSize(4 << 10))).contains("--gpu-staging"));
    for depth in [0, 1, 9] {
        let e = bad(with(|c| c.gpu_staging_depth = Some(depth)));
        assert!(e.contains("--gpu-staging-depth") && e.contains("between 2 and 8"), "{e}");
    }
    let depth = |staging: &str, depth: Option<usize>| {
        with(|c| {
            c.gpu_staging = staging.parse().unwrap();
            c.gpu_staging_depth = depth;
        })
        .validate()
        .unwrap()
        .gpu_staging_depth
    };
    assert_eq!(depth("64MiB", Some(8)), 8);
    // Unset: as many parts as the staging holds 64 MiB jobs, 2 to 8.
    assert_eq!(depth("64MiB", None), 2);
    assert_eq!(depth("16MiB", None), 2);
    assert_eq!(depth("256MiB", None), 4);
    assert_eq!(depth("200MiB", None), 3);
    assert_eq!(depth("4GiB", None), 8);
    // The defaults: 256 MiB in four parts of one job each.
    let d = ServerConfig::default().validate().unwrap();
    assert_eq!((d.gpu_staging_bytes, d.gpu_staging_depth), (256 << 20, 4));
    for job in [4 << 10, 8 << 30] {
        let e = bad(with(|c| c.gpu_job = ByteSize(job)));
        assert!(e.contains("--gpu-job"), "{job}: {e}");
    }
    assert!(bad(with(|c| c.gpu_queue_depth = 0)).contains("--gpu-queue-depth"));
    assert!(bad(with(|c| c.max_gpu_registrations = 0)).contains("--max-gpu-registrations"));
    assert!(bad(with(|c| c.shards = 1000)).contains("--shards"));
    assert!(bad(with(|c| c.ssd = ByteSize(1 << 30))).contains("--ssd"));
}

#[test]
fn bad_flag_values_are_refused_naming_the_flag() {
    for (argv, flag) in [
        (&["--dram", "lots"][..], "--dram"),
        (&["--spin-window", "fast"], "--spin-window"),
        (&["--gpu-checksums", "gpu2"], "--gpu-checksums"),
        (&["--gpu-checksums", "tables"], "--gpu-checksums"),
        (&["--gpu-copy", "direct"], "--gpu-copy"),
        (&["--gpu", "maybe"], "--gpu"),
        (&["--max-sessions", "many"], "--max-sessions"),
    ] {
        let e = flags(argv).unwrap_err();
        assert!(e.contains(flag), "{argv:?}: {e}");
    }
    // Experiments that lost and fault injection are not options of a release build.
    for gone in ["--gpu-staging-gate", "--gpu-shard-checksums"] {
        let e = flags(&[gone, "1"]).unwrap_err();
        assert!(e.contains(gone), "{gone}: {e}");
    }
    // SSD fault injection is failpoints (FAILPOINTS), in every build no flag.
    for gone in ["--ssd-inject-latency", "--ssd-inject-errors-every"] {
        assert!(flags(&[gone, "1"]).unwrap_err().contains(gone));
    }
}

#[test]
fn flags_parse_into_typed_values() {
    let c = flags(&[
        "--dram",
        "64MiB",
        "--no-pin",
        "--no-lock-arena",
        "--allow-uid",
        "7",
        "--allow-uid",
        "8",
        "--gpu",
        "off",
        "--gpu-copy",
        "batched",
        "--gpu-checksums",
        "cpu",
        "--gpu-timeline",
        "--idle-poll-max",
        "1ms",
        "--gpu-staging-depth",
        "3",
    ])
    .unwrap();
    assert_eq!(c.dram.bytes(), 64 << 20);
    assert!(!c.pin && !c.lock_arena && c.gpu_timeline);
    assert_eq!(c.allow_uid, vec![7, 8]);
    assert_eq!(
        (c.gpu, c.gpu_copy, c.gpu_checksums),
        (GpuMode::Off, Strategy::Batched, ChecksumPlace::Cpu)
    );
    assert_eq!(c.idle_poll_max.duration(), Duration::from_millis(1));
    assert_eq!(c.gpu_staging_depth, Some(3));
    assert_eq!(flags(&[]).unwrap(), ServerConfig::default());
}

#[test]
fn the_file_is_read_and_flags_given_override_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("orbitkv.toml");
    std::fs::write(
        &path,
        "dram = \"64MiB\"\nshards = 2\nallow-uid = [1000]\npin = false\ngpu-copy = \"staged\"\n\
         gpu-staging-depth = 3\nspin-window = \"1ms\"\n",
    )
    .unwrap();
    let file = path.to_str().unwrap();
    let c = flags(&["--config", file]).unwrap();
    assert_eq!((c.dram.bytes(), c.shards, c.pin), (64 << 20, 2, false));
    assert_eq!((c.gpu_copy, c.gpu_staging_depth), (Strategy::Staged, Some(3)));
    assert_eq!(c.spin_window.duration(), Duration::from_millis(1));
    // Flags given replace the file's values (lists grow); flags not given leave them.
    let c = flags(&["--config", file, "--dram", "128MiB", "--allow-uid", "7", "--gpu-timeline"])
        .unwrap();
    assert_eq!((c.dram.bytes(), c.shards, c.pin, c.gpu_timeline), (128 << 20, 2, false, true));
    assert_eq!(c.allow_uid, vec![1000, 7]);
    assert_eq!(c.gpu_copy, Strategy::Staged);
    // Bad files name the file and the key.
    for (text, key) in [
        ("bogus = 1", "bogus"),
        ("dram = \"lots\"", "dram"),
        ("gpu-copy = \"direct\"", "gpu-copy"),
        ("gpu-staging-gate = \"host\"", "gpu-staging-gate"),
        ("ssd-queue-depth = \"deep\"", "ssd-queue-depth"),
    ] {
        std::fs::write(&path, text).unwrap();
        let e = flags(&["--config", file]).unwrap_err();
        assert!(e.contains("orbitkv.toml") && e.contains(key), "{text}: {e}");
    }
    let e = flags(&["--config", "/nonexistent/orbitkv.toml"]).unwrap_err();
    assert!(e.contains("/nonexistent/orbitkv.toml"), "{e}");
}

#[test]
fn the_printed_config_reads_back_as_the_same_config() {
    let c = flags(&["--dram", "1536MiB", "--spin-window", "250us", "--gpu-staging-depth", "2"])
        .unwrap();
    let text = toml::to_string(&c).unwrap();
    assert!(
        text.contains("dram = \"1536MiB\"") && text.contains("spin-window = \"250us\""),
        "{text}"
    );
    assert_eq!(toml::from_str::<ServerConfig>(&text).unwrap(), c);
    let d = toml::to_string(&ServerConfig::default()).unwrap();
    assert_eq!(toml::from_str::<ServerConfig>(&d).unwrap(), ServerConfig::default());
    // Operator options only: no experiments, no fault injection in a release build.
    for gone in ["staging-gate", "shard-checksums"] {
        assert!(!d.contains(gone), "{d}");
    }
    assert!(!d.contains("inject"), "{d}");
}

#[test]
fn the_shipped_config_file_states_the_defaults() {
    let c: ServerConfig = toml::from_str(include_str!("../../deploy/orbitkv.toml"))
        .expect("deploy/orbitkv.toml: a key the server no longer knows?");
    c.validate().expect("deploy/orbitkv.toml validates");
    // Everything but the arena's size and the metrics listener (a host's choices) is the
    // default.
    let d = ServerConfig::default();
    assert_eq!(ServerConfig { dram: d.dram, metrics_addr: d.metrics_addr, ..c }, d);
}

/// The reference of every option, read by the tests below.
const REFERENCE: &str = include_str!("../../docs/configuration.md");

/// Whether `text` names `word` on its own: not as the start of a longer flag or key (`--ssd`
/// in `--ssd-dir`).
fn names(text: &str, word: &str) -> bool {
    text.match_indices(word).any(|(at, _)| {
        let next = text[at + word.len()..].chars().next();
        !next.is_some_and(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    })
}

/// The reference's table row of the long flag `flag`: the one line that starts with it.
fn row(flag: &str) -> &'static str {
    let rows: Vec<&str> = REFERENCE
        .lines()
        .filter(|l| {
            l.strip_prefix("| `")
                .and_then(|l| l.strip_prefix(flag))
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('`'))
        })
        .collect();
    assert_eq!(rows.len(), 1, "docs/configuration.md: one table row for {flag}: {rows:?}");
    rows[0]
}

/// A configuration with every option that has no value by default set, so that its TOML
/// (what `--print-config` prints) has every key.
fn every_key_set() -> ServerConfig {
    flags(&[
        "--socket",
        "/run/orbitkv/test.sock",
        "--metrics-addr",
        "127.0.0.1:9464",
        "--ssd-dir",
        "/var/lib/orbitkv",
        "--gpu-staging-depth",
        "3",
        "--allow-uid",
        "1000",
        "--socket-group",
        "0",
        "--etcd",
        "http://127.0.0.1:2379",
        "--node-id",
        "n1",
        "--peer-addr",
        "127.0.0.1:7000",
        "--te-library",
        "/opt/mooncake/lib/libtransfer_engine.so",
    ])
    .unwrap()
}

/// The long flags of this build's command line (without `--help` and `--version`).
fn long_flags() -> Vec<String> {
    Args::command()
        .get_arguments()
        .filter_map(|a| a.get_long())
        .filter(|l| !matches!(*l, "help" | "version"))
        .map(|l| format!("--{l}"))
        .collect()
}

#[test]
fn the_reference_documents_every_flag_and_key() {
    let built = long_flags();
    for flag in ["--config", "--print-config", "--metrics-addr", "--no-pin", "--no-lock-arena"] {
        assert!(built.iter().any(|l| l == flag), "{flag} is not a flag: {built:?}");
    }
    for flag in &built {
        assert!(names(REFERENCE, flag), "docs/configuration.md does not name {flag}");
        let _ = row(flag);
    }

    // Every key of the printed configuration: one per option, --config and --print-config
    // aside (flags only).
    let printed = toml::Table::try_from(every_key_set()).unwrap();
    assert_eq!(printed.len(), built.len() - 2, "{printed:?}");
    for key in printed.keys() {
        assert!(
            REFERENCE.contains(&format!("`{key}`")),
            "docs/configuration.md does not name the key `{key}`"
        );
    }
}

/// Each option's row states, in its default column, the default the code has (what
/// `--print-config` prints).
#[test]
fn the_reference_states_each_default() {
    let defaults = toml::Table::try_from(ServerConfig::default()).unwrap();
    let mut checked = 0;
    for arg in Args::command().get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        let key = arg.get_id().as_str().replace('_', "-");
        let Some(value) = defaults.get(&key) else { continue };
        let line = row(&format!("--{long}"));
        // | flag / key | meaning | default | unit, range |
        let cells: Vec<&str> = line.split(" | ").collect();
        assert_eq!(cells.len(), 4, "--{long}: {line}");
        let cell = cells[2];
        let stated = match value {
            toml::Value::String(s) => cell.contains(&format!("`{s}`")),
            toml::Value::Integer(n) => cell.split_whitespace().next() == Some(&n.to_string()),
            toml::Value::Boolean(b) => cell.contains(&format!("{b}`")),
            toml::Value::Array(a) => a.is_empty() && cell.contains("`[]`"),
            other => panic!("--{long}: a default of an unexpected type: {other}"),
        };
        assert!(stated, "--{long}: the default {value} is not in its row's default: {cell}");
        checked += 1;
    }
    assert!(checked >= 25, "{checked} defaults checked");
}

/// What `--print-config` prints (`toml::to_string`, as main does) is a config file that gives
/// the same configuration, and prints the same again.
#[test]
fn print_config_output_round_trips_through_a_file() {
    let argv = vec![
        "--socket",
        "/run/orbitkv/test.sock",
        "--metrics-addr",
        "[::1]:9464",
        "--shards",
        "3",
        "--dram",
        "1000",
        "--no-pin",
        "--no-lock-arena",
        "--allow-uid",
        "7",
        "--allow-uid",
        "8",
        "--max-chunk-size",
        "1.5GiB",
        "--spin-window",
        "1500ns",
        "--drain-timeout",
        "1.5s",
        "--ssd-dir",
        "/var/lib/orbitkv",
        "--ssd",
        "2GB",
        "--ssd-region-size",
        "128KiB",
        "--gpu",
        "off",
        "--gpu-staging-depth",
        "3",
        "--gpu-copy",
        "batched",
        "--gpu-checksums",
        "verify",
        "--gpu-timeline",
    ];
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("printed.toml");
    let file = path.to_str().unwrap();
    for (what, config) in [
        ("defaults", ServerConfig::default()),
        ("every key", every_key_set()),
        ("non-defaults", flags(&argv).unwrap()),
        ("a v4 metrics address", flags(&["--metrics-addr", "0.0.0.0:9100"]).unwrap()),
    ] {
        let printed = toml::to_string(&config).unwrap();
        std::fs::write(&path, &printed).unwrap();
        let read = flags(&["--config", file]).unwrap();
        assert_eq!(read, config, "{what}: {printed}");
        assert_eq!(toml::to_string(&read).unwrap(), printed, "{what}");
    }
    let c = flags(&argv).unwrap();
    let printed = toml::to_string(&c).unwrap();
    assert!(printed.contains("metrics-addr = \"[::1]:9464\""), "{printed}");
    assert_eq!(c.metrics_addr, Some("[::1]:9464".parse().unwrap()));
    // The whole command line, file then flags, is what --print-config reports.
    let (c, print) = from_command_line(["orbitkv-server", "--config", file, "--print-config"])
        .map_err(|e| e.to_string())
        .unwrap();
    assert!(print);
    assert_eq!(c.metrics_addr, Some("0.0.0.0:9100".parse().unwrap()));
}

/// `--model-quota` replaces the values it names for that model's namespaces, keeps the
/// `--namespace-*` values for the rest, and is checked as they are, naming the model.
#[test]
fn model_quotas_take_the_flags_values_they_do_not_name() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let c = flags(&[
        "--shards",
        "2",
        "--dram",
        "64MiB",
        "--ssd-dir",
        d,
        "--ssd",
        "1GiB",
        "--ssd-region-size",
        "1MiB",
        "--namespace-dram-limit",
        "8MiB",
        "--namespace-ssd-guarantee",
        "64MiB",
        "--model-quota",
        "org/big:v2:dram-limit=32MiB,dram-guarantee=16MiB",
        "--model-quota",
        "small:ssd-guarantee=0",
    ])
    .unwrap();
    assert_eq!(c.model_quota.len(), 2);
    let s = c.validate().unwrap();
    let share = |limit_mib: u64, guarantee_mib: u64, ssd_guarantee_mib: u64| NamespaceQuota {
        dram_limit_pages: (limit_mib << 20) / 2 / 4096,
        dram_guarantee_pages: (guarantee_mib << 20) / 2 / 4096,
        ssd_limit_bytes: 0,
        ssd_guarantee_bytes: (ssd_guarantee_mib << 20) / 2,
    };
    assert_eq!(s.quota, share(8, 0, 64));
    assert_eq!(
        s.model_quotas,
        vec![("org/big:v2".to_string(), share(32, 16, 64)), ("small".to_string(), share(8, 0, 0))]
    );
    // Printed and read back, the list is the same.
    let printed = toml::to_string(&c).unwrap();
    assert!(printed.contains("\"org/big:v2:dram-limit=32MiB,dram-guarantee=16MiB\""), "{printed}");
    assert_eq!(toml::from_str::<ServerConfig>(&printed).unwrap(), c);

    let e = flags(&["--model-quota", "m:dram-limit=much"]).unwrap_err();
    assert!(e.contains("--model-quota") && e.contains("dram-limit"), "{e}");
    for (edit, flag, why) in [
        (vec!["--model-quota", "m:dram-guarantee=2GiB"], "--model-quota", "m:dram-guarantee=2GiB"),
        (
            vec!["--model-quota", "m:dram-limit=1MiB", "--model-quota", "m:ssd-limit=1MiB"],
            "--model-quota",
            "given twice",
        ),
        (vec!["--namespace-ssd-guarantee", "1MiB"], "--namespace-ssd-guarantee", "SSD tier"),
        (
            vec!["--namespace-ssd-limit", "1MiB", "--namespace-ssd-guarantee", "2MiB"],
            "--namespace-ssd-guarantee",
            "SSD limit",
        ),
        (
            vec!["--ssd-dir", d, "--ssd", "1GiB", "--namespace-ssd-guarantee", "600MiB"],
            "--namespace-ssd-guarantee",
            "half of --ssd",
        ),
        (
            vec!["--ssd-dir", d, "--ssd", "1GiB", "--model-quota", "m:ssd-guarantee=600MiB"],
            "--model-quota",
            "half of --ssd",
        ),
    ] {
        let e = bad(flags(&edit).unwrap());
        assert!(e.contains(flag) && e.contains(why), "{edit:?}: {e}");
    }
}
