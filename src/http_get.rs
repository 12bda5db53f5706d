//! An HTTP GET (ureq) and a reader of the text exposition, for reading our
//! own agent, and the Prometheus and Alertmanager of the tests, on loopback:
//! the demo's live view, the benchmarks and the end-to-end tests.

use std::net::SocketAddr;
use std::time::Duration;

/// GETs `path` (query already encoded) from `addr`; returns (status code,
/// body) whatever the status: the callers tell a 404 from a 200 themselves.
/// Connecting may take 2 s and the whole exchange 10 s; no proxy is used.
pub fn get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .proxy(None)
        .timeout_connect(Some(Duration::from_secs(2)))
        .timeout_global(Some(Duration::from_secs(10)))
        .build()
        .into();
    let mut response = agent
        .get(format!("http://{addr}{path}"))
        .call()
        .map_err(std::io::Error::other)?;
    let status = response.status().as_u16();
    // A long job's rank report is megabytes: no limit on our own endpoints.
    let body = response
        .body_mut()
        .with_config()
        .limit(u64::MAX)
        .read_to_string()
        .map_err(std::io::Error::other)?;
    Ok((status, body))
}

/// One sample line of a text exposition.
pub struct Sample<'a> {
    /// Metric name.
    pub name: &'a str,
    /// (key, value) pairs, values as written (escapes kept).
    pub labels: Vec<(&'a str, &'a str)>,
    /// The value.
    pub value: f64,
}

/// Parses one line of a text exposition; None for comments, blank lines and
/// lines that do not parse.
pub fn parse_sample(line: &str) -> Option<Sample<'_>> {
    if line.starts_with('#') {
        return None;
    }
    let (series, value) = line.trim_end().rsplit_once(' ')?;
    let value = value.parse().ok()?;
    let Some((name, rest)) = series.split_once('{') else {
        return Some(Sample {
            name: series,
            labels: Vec::new(),
            value,
        });
    };
    let mut labels = Vec::new();
    let mut rest = rest.strip_suffix('}')?;
    while !rest.is_empty() {
        let (key, after) = rest.split_once("=\"")?;
        let end = closing_quote(after)?;
        labels.push((key.trim_start_matches(','), &after[..end]));
        rest = &after[end + 1..];
    }
    Some(Sample {
        name,
        labels,
        value,
    })
}

/// Index of the quote that closes a label value: the first one not
/// escaped, a backslash escaping the character after it (so `"a\\"` ends
/// at its last quote: the backslash before that quote is itself escaped).
fn closing_quote(value: &str) -> Option<usize> {
    let mut escaped = false;
    for (i, c) in value.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            '"' => return Some(i),
            _ => {}
        }
    }
    None
}

/// Value of the first series of metric `name` whose labels include every
/// pair of `labels` exactly (so `rank="1"` does not match `local_rank="1"`).
pub fn metric_value(exposition: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    exposition.lines().find_map(|line| {
        let s = parse_sample(line)?;
        (s.name == name && labels.iter().all(|l| s.labels.contains(l))).then_some(s.value)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# HELP x_total things\n\
        # TYPE x_total counter\n\
        x_total{node=\"n\",local_rank=\"1\",rank=\"0\"} 3\n\
        x_total{node=\"n\",rank=\"1\",msg=\"a \\\"q\\\" b\"} 4\n\
        up 1\n";

    #[test]
    fn a_value_ending_in_an_escaped_backslash_ends_at_its_quote() {
        // `path="C:\\"` in the text: the value `C:\`, its backslash escaped.
        let text = "x{path=\"C:\\\\\",rank=\"3\"} 7\n";
        let s = parse_sample(text.lines().next().unwrap()).unwrap();
        assert_eq!(s.labels, [("path", "C:\\\\"), ("rank", "3")]);
        assert_eq!(metric_value(text, "x", &[("rank", "3")]), Some(7.0));
    }

    #[test]
    fn labels_match_whole_pairs_only() {
        assert_eq!(metric_value(TEXT, "x_total", &[("rank", "1")]), Some(4.0));
        assert_eq!(metric_value(TEXT, "x_total", &[("rank", "0")]), Some(3.0));
        assert_eq!(metric_value(TEXT, "x_total", &[("rank", "2")]), None);
        assert_eq!(metric_value(TEXT, "x", &[]), None);
        assert_eq!(metric_value(TEXT, "up", &[]), Some(1.0));
        assert_eq!(
            metric_value(TEXT, "x_total", &[("msg", "a \\\"q\\\" b")]),
            Some(4.0)
        );
    }
}
