//! The entry point for the fuzz target (`fuzz/`, cargo fuzz) into the one decoder of outside
//! input that lives in the server: it takes arbitrary bytes and must never panic.

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
