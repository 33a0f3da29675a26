//! The whole configuration document: every component's section in one place.

use avm_common::auth::AuthConfig;
use avm_common::config::{DatabaseConfig, GrpcConfig, LogConfig, PeersConfig, RedisConfig, ServerConfig};
use avm_common::settings;
use avm_config::{ConfigServiceConfig, Deployment};
use avm_gateway::GatewayConfig;
use avm_runtime::{BillingConfig, LlmConfig, RuntimeConfig};
use avm_session::SessionConfig;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// AgentVM's configuration, loaded by `avm_common::config::load`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AvmConfig {
    pub server: ServerConfig,
    pub grpc: GrpcConfig,
    pub log: LogConfig,
    pub database: DatabaseConfig,
    pub redis: RedisConfig,
    pub peers: PeersConfig,
    pub auth: AuthConfig,
    pub gateway: GatewayConfig,
    pub runtime: RuntimeConfig,
    pub llm: LlmConfig,
    pub billing: BillingConfig,
    pub config: ConfigServiceConfig,
    pub session: SessionConfig,
}

impl AvmConfig {
    /// Returns the layers the config service starts from: the built-in
    /// defaults, and what this configuration (file, environment, flags) made
    /// of them.
    pub fn deployment(&self) -> Deployment {
        Deployment {
            defaults: AvmConfig::default().settings_tree(),
            values: self.settings_tree(),
        }
    }

    fn settings_tree(&self) -> Map<String, Value> {
        let mut tree = self.llm.settings_tree();
        tree.extend(self.runtime.settings_tree());
        tree.extend(self.billing.settings_tree());
        tree.insert(
            settings::SYSTEM_DATA_DIR.into(),
            Value::from(self.server.data_dir.clone()),
        );
        tree.insert(settings::SYSTEM_LOG_LEVEL.into(), Value::from(self.log.level.clone()));
        tree
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_of_the_deployment_layer_is_in_the_config_schema() {
        let deployment = AvmConfig::default().deployment();
        for (key, value) in &deployment.values {
            let spec = avm_config::schema::spec(key).unwrap_or_else(|| panic!("{key} is not in the config schema"));
            if !value.is_null() {
                assert_eq!(spec.check(value).as_ref(), Ok(value), "{key}");
            }
        }
    }
}

#[cfg(test)]
// `figment::Jail` takes closures that return figment's own (large) error.
#[allow(clippy::result_large_err)]
mod fuzz {
    //! Configuration values under arbitrary input: any string in any
    //! `AVM_<SECTION>_<KEY>` variable, and any TOML value in the file, loads
    //! or fails with an error that names the key, never a panic.

    use avm_common::config::{Sources, load};
    use proptest::prelude::*;
    use proptest::test_runner::TestCaseError;

    use super::*;

    /// Returns every `section.key` the environment can set.
    fn keys() -> Vec<(String, String)> {
        let Ok(Value::Object(sections)) = serde_json::to_value(AvmConfig::default()) else {
            return Vec::new();
        };
        let mut keys = Vec::new();
        for (section, fields) in sections {
            if let Value::Object(fields) = fields {
                keys.extend(fields.keys().map(|key| (section.clone(), key.clone())));
            }
        }
        keys
    }

    /// Keys whose value is any text.
    const STRING_KEYS: &[(&str, &str)] = &[
        ("server", "host"),
        ("server", "data_dir"),
        ("server", "listen"),
        ("server", "advertise"),
        ("redis", "key_prefix"),
        ("auth", "issuer"),
        ("log", "level"),
        ("peers", "auth"),
        ("peers", "runtime"),
    ];

    /// Returns the variable that sets `section.key`.
    fn env_name(section: &str, key: &str) -> String {
        if section == "peers" {
            format!("AVM_{key}_ADDR").to_uppercase()
        } else {
            format!("AVM_{section}_{key}").to_uppercase()
        }
    }

    /// Fails the case unless loading gave a configuration or an error naming `section.key`.
    fn named(
        result: Result<AvmConfig, avm_common::config::ConfigError>,
        section: &str,
        key: &str,
    ) -> Result<(), TestCaseError> {
        if let Err(err) = result {
            let text = err.to_string();
            prop_assert!(
                text.contains(&format!("{section}.{key}")),
                "the error does not name {}.{}: {}",
                section,
                key,
                text
            );
        }
        Ok(())
    }

    /// Values as people type them into variables.
    fn env_value() -> impl Strategy<Value = String> {
        prop_oneof![
            any::<String>(),
            prop::sample::select(vec![
                "",
                "0",
                "-1",
                "65536",
                "18446744073709551616",
                "1e400",
                "true",
                "yes",
                "[1, 2]",
                "{a = 1}",
                "10s",
                "5 minutes",
                "1d",
                "999999999999y",
                "-3s",
                "http://[::1",
                "sqlite://",
                "${HOME}",
            ])
            .prop_map(str::to_owned),
        ]
        .prop_map(|value| value.replace('\0', ""))
    }

    /// TOML values of every type.
    fn toml_value() -> impl Strategy<Value = toml::Value> {
        let leaf = prop_oneof![
            env_value().prop_map(toml::Value::String),
            any::<i64>().prop_map(toml::Value::Integer),
            any::<f64>().prop_map(toml::Value::Float),
            any::<bool>().prop_map(toml::Value::Boolean),
        ];
        leaf.prop_recursive(2, 8, 3, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..3).prop_map(toml::Value::Array),
                prop::collection::btree_map("[a-z_]{1,8}", inner, 0..3)
                    .prop_map(|map| toml::Value::Table(map.into_iter().collect())),
            ]
        })
    }

    #[test]
    fn text_figment_cannot_unescape_is_kept_as_written() {
        for value in ["\"\u{10a0c}\u{1f5f}a\\A\"", "[\"\u{e9}\\n\"]"] {
            let mut loaded = None;
            let jailed = figment::Jail::try_with(|jail| {
                jail.set_env("AVM_SERVER_HOST", value);
                loaded = Some(load::<AvmConfig>(&Sources::default()).map(|config| config.server.host));
                Ok(())
            });
            assert!(jailed.is_ok(), "{jailed:?}");
            assert_eq!(loaded.and_then(Result::ok).as_deref(), Some(value));
        }
    }

    proptest! {
        #[test]
        fn any_environment_value_loads_or_names_its_key(key in prop::sample::select(keys()), value in env_value()) {
            let (section, field) = key;
            let mut outcome = Ok(());
            let jailed = figment::Jail::try_with(|jail| {
                jail.set_env(env_name(&section, &field), &value);
                outcome = named(load::<AvmConfig>(&Sources::default()), &section, &field);
                Ok(())
            });
            prop_assert!(jailed.is_ok(), "{:?}", jailed);
            outcome?;
        }

        #[test]
        fn any_text_of_a_string_key_is_kept_as_written(
            key in prop::sample::select(STRING_KEYS),
            value in env_value().prop_filter("an array or table", |v| !v.trim_start().starts_with(['[', '{'])),
        ) {
            let (section, field) = key;
            let mut loaded = None;
            let jailed = figment::Jail::try_with(|jail| {
                jail.set_env(env_name(section, field), &value);
                loaded = Some(load::<AvmConfig>(&Sources::default()).map_err(|err| err.to_string()));
                Ok(())
            });
            prop_assert!(jailed.is_ok(), "{:?}", jailed);
            let config = loaded.unwrap_or_else(|| Err("not loaded".to_owned())).map_err(TestCaseError::fail)?;
            let shown = serde_json::to_value(config).unwrap_or_default();
            prop_assert_eq!(&shown[section][field], &Value::from(value));
        }

        #[test]
        fn any_file_value_loads_or_names_its_key(key in prop::sample::select(keys()), value in toml_value()) {
            let (section, field) = key;
            let mut outcome = Ok(());
            let jailed = figment::Jail::try_with(|jail| {
                let mut table = toml::Table::new();
                table.insert(field.clone(), value.clone());
                let mut document = toml::Table::new();
                document.insert(section.clone(), toml::Value::Table(table));
                jail.create_file("avm.toml", &document.to_string())?;
                let sources = Sources {
                    file: Some("avm.toml".into()),
                    ..Sources::default()
                };
                outcome = named(load::<AvmConfig>(&sources), &section, &field);
                Ok(())
            });
            prop_assert!(jailed.is_ok(), "{:?}", jailed);
            outcome?;
        }
    }
}
