//! What the control plane may see of a plan: counts per action and the addresses.

use std::collections::BTreeMap;

/// Counts per action and the addresses: what the control plane may see of a plan.
pub(super) fn summary(plan: &serde_json::Value) -> serde_json::Value {
    let mut counts: BTreeMap<&str, u64> = BTreeMap::new();
    let mut addresses: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for rc in plan["resource_changes"].as_array().map(Vec::as_slice).unwrap_or_default() {
        let actions: Vec<&str> = rc["change"]["actions"]
            .as_array()
            .map(|a| a.iter().filter_map(|x| x.as_str()).collect())
            .unwrap_or_default();
        let action = match actions.as_slice() {
            ["no-op"] => continue,
            ["create"] => "create",
            ["update"] => "update",
            ["delete"] => "delete",
            ["read"] => "read",
            [_, _] => "replace",
            _ => "other",
        };
        *counts.entry(action).or_default() += 1;
        addresses.entry(action).or_default().push(rc["address"].as_str().unwrap_or("").to_string());
    }
    serde_json::json!({ "counts": counts, "addresses": addresses })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_counts_actions_and_lists_addresses() {
        let plan = serde_json::json!({"resource_changes": [
            {"address": "a.x", "change": {"actions": ["create"]}},
            {"address": "a.y", "change": {"actions": ["delete", "create"]}},
            {"address": "a.z", "change": {"actions": ["no-op"]}},
            {"address": "a.w", "change": {"actions": ["update"]}},
        ]});
        let s = summary(&plan);
        assert_eq!(s["counts"], serde_json::json!({"create": 1, "replace": 1, "update": 1}));
        assert_eq!(s["addresses"]["replace"][0], "a.y");
    }
}
