// Copyright (c) Microsoft Corporation.
// Licensed under the MIT License.

#![allow(clippy::unseparated_literal_suffix, clippy::pattern_type_mismatch)]

use crate::ast::{Expr, Ref};
use crate::builtins;
use crate::builtins::utils::ensure_args_count;
use crate::lexer::Span;
use crate::value::Value;
use crate::*;

use anyhow::{bail, Result};

pub fn register(m: &mut builtins::BuiltinsMap<&'static str, builtins::BuiltinFcn>) {
    m.insert("to_number", (to_number, 1));
}

fn to_number(span: &Span, params: &[Ref<Expr>], args: &[Value], _strict: bool) -> Result<Value> {
    let name = "to_number";
    ensure_args_count(span, name, params, args, 1)?;

    let span = params[0].span();
    Ok(match &args[0] {
        Value::Null => Value::from(0u64),
        Value::Bool(true) => Value::from(1u64),
        Value::Bool(false) => Value::from(0u64),
        Value::Number(_) => args[0].clone(),
        // Eventhough the doc says that strings are converted using strconv.Atoi golang method,
        // in practice strings seems to be read as json numbers. This means that floating point
        // numbers are read and the string representation is limited to what json allows.
        // byoc patch: OPA parses with Go's strconv.ParseFloat (".25", "+1", "1.", "007"
        // are numbers there), refusing infinities and NaN; upstream read JSON numbers only.
        Value::String(s) => match go_float_as_json(s).map(|n| Value::from_json_str(&n)) {
            Some(Ok(Value::Number(n))) => Value::Number(n),
            _ => {
                bail!(span.error("could not parse string as number"));
            }
        },
        _ => {
            bail!(
                span.error(format!("`{name}` expects bool/number/string/null argument.").as_str())
            );
        }
    })
}

/// A number as Go's `strconv.ParseFloat` reads it, rewritten as a JSON number: an
/// optional sign, then decimal digits with an optional point on either side and an
/// optional exponent, or a hexadecimal mantissa with a `p` exponent; `_` only between
/// digits. `None` for anything else, and for a value out of `f64`'s range (as Go).
fn go_float_as_json(s: &str) -> Option<alloc::string::String> {
    use alloc::string::String;
    let (negative, body) = match s.as_bytes().first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    };
    let b = body.as_bytes();
    // Go: an underscore must separate digits (or follow a base prefix).
    for (i, c) in b.iter().enumerate() {
        if *c == b'_' {
            let digit = |j: usize| b.get(j).is_some_and(|c| c.is_ascii_hexdigit());
            let after_prefix = i == 2 && (b[1] == b'x' || b[1] == b'X');
            if !(i > 0 && (digit(i - 1) || after_prefix) && digit(i + 1)) {
                return None;
            }
        }
    }
    let body: String = body.chars().filter(|c| *c != '_').collect();
    let sign = if negative { "-" } else { "" };
    if let Some(hex) = body.strip_prefix("0x").or_else(|| body.strip_prefix("0X")) {
        let value = hex_float(hex)?;
        return Some(alloc::format!("{sign}{value}"));
    }
    let b = body.as_bytes();
    let mut i = 0;
    while i < b.len() && b[i].is_ascii_digit() {
        i += 1;
    }
    let int = &body[..i];
    let mut frac = "";
    if i < b.len() && b[i] == b'.' {
        let f = i + 1;
        i = f;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        frac = &body[f..i];
    }
    if int.is_empty() && frac.is_empty() {
        return None;
    }
    let mut exp = "";
    if i < b.len() && (b[i] == b'e' || b[i] == b'E') {
        let e = i;
        i += 1;
        if i < b.len() && (b[i] == b'+' || b[i] == b'-') {
            i += 1;
        }
        let digits = i;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        if i == digits {
            return None;
        }
        exp = &body[e..i];
    }
    if i != b.len() {
        return None;
    }
    let int = int.trim_start_matches('0');
    let mut out = String::from(sign);
    out.push_str(if int.is_empty() { "0" } else { int });
    if !frac.is_empty() {
        out.push('.');
        out.push_str(frac);
    }
    out.push_str(exp);
    // Go refuses what overflows a float64 (ErrRange).
    match out.parse::<f64>() {
        Ok(f) if f.is_finite() => Some(out),
        _ => None,
    }
}

/// A hexadecimal float's value: mantissa digits with an optional point, then a
/// mandatory `p` exponent (Go's syntax).
fn hex_float(hex: &str) -> Option<f64> {
    let (mantissa, exp) = hex.split_once(['p', 'P'])?;
    let exp: i32 = exp.parse().ok()?;
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    if int.is_empty() && frac.is_empty() {
        return None;
    }
    let mut value = 0f64;
    for c in int.chars().chain(frac.chars()) {
        value = value * 16.0 + f64::from(c.to_digit(16)?);
    }
    let scale = exp.checked_sub(4 * i32::try_from(frac.len()).ok()?)?;
    // Scaling by halves and doubles (no `powi` without std); past ±2,200 the value is
    // infinite or zero whatever the mantissa.
    let mut value = value;
    for _ in 0..scale.unsigned_abs().min(2_200) {
        value = if scale > 0 { value * 2.0 } else { value / 2.0 };
    }
    value.is_finite().then_some(value)
}
