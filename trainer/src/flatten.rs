//! JSON trees as flat (path, value) lists: TensorBoard's and MLflow's metric names,
//! MLflow's params, the report's tables.

use serde_json::Value;

/// Every leaf under `value` with its path: `prefix`, then each key, joined by `sep`
/// (`prefix` empty: the path starts with the first key). Lists are leaves, and so are
/// empty objects.
pub fn leaves<'a>(prefix: &str, sep: char, value: &'a Value) -> Vec<(String, &'a Value)> {
    fn walk<'a>(path: &str, sep: char, v: &'a Value, out: &mut Vec<(String, &'a Value)>) {
        match v {
            Value::Object(m) if !m.is_empty() => {
                for (k, v) in m {
                    let key = if path.is_empty() {
                        k.clone()
                    } else {
                        format!("{path}{sep}{k}")
                    };
                    walk(&key, sep, v, out);
                }
            }
            leaf => out.push((path.to_owned(), leaf)),
        }
    }
    let mut out = Vec::new();
    walk(prefix, sep, value, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn leaves_carry_their_path() {
        let v = json!({"a": 1, "b": {"c": [1, 2], "d": {}}, "e": null});
        let got: Vec<(String, String)> = leaves("run", '/', &v)
            .into_iter()
            .map(|(k, v)| (k, v.to_string()))
            .collect();
        assert_eq!(
            got,
            [
                ("run/a", "1"),
                ("run/b/c", "[1,2]"),
                ("run/b/d", "{}"),
                ("run/e", "null")
            ]
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
        );
        assert_eq!(leaves("", '.', &json!({"x": {"y": 2}}))[0].0, "x.y");
        assert_eq!(leaves("", '.', &json!(3))[0].0, "");
    }
}
