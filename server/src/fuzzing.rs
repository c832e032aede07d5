//! Entry points for the fuzz targets (`fuzz/`, cargo fuzz) into the decoders of outside input
//! that live in the server: each takes arbitrary bytes and must never panic.

/// A line on the admin socket: parsed as the server parses it, an `evict`'s target read, and
/// a request that parses says the same (its command, and an evict's target) once serialized
/// and parsed again. Only what the server acts on is compared: other members may be floats,
/// which serde_json does not parse back bit for bit.
pub fn admin_request(data: &[u8]) {
    let Ok(line) = std::str::from_utf8(data) else { return };
    let Ok((cmd, v)) = crate::control::admin::parse_request(line) else { return };
    let target = crate::control::admin::evict_target(&v);
    let (again, w) =
        crate::control::admin::parse_request(&v.to_string()).expect("a parsed request re-parses");
    assert_eq!(again, cmd);
    assert_eq!(crate::control::admin::evict_target(&w), target);
}

/// A config file's text, as `--config` reads it: TOML into the options, then validated (a
/// config that validates prints, with `--print-config`, as TOML that reads back the same).
pub fn config_file(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(settings) = crate::config::from_file_text(text) {
        let printed = toml::to_string(&settings.config).expect("a configuration prints");
        let back = crate::config::from_file_text(&printed).expect("what printed reads back");
        assert_eq!(back.config, settings.config, "{printed}");
    }
}
