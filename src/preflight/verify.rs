//! `--verify-advice`: the script run again at the micro-batch the agent
//! advised, to see whether it fits.
//!
//! Preflight does not change the script; the user says how the micro-batch
//! size reaches it: a command-line argument (`--batch-arg --batch` rewrites
//! `--batch 8` or `--batch=8`; `--batch-arg data.batch_size` rewrites a
//! `data.batch_size=8` override, Hydra's form) or an environment variable
//! the script reads (`--batch-env MICRO_BATCH`). The setting is checked
//! before the first run, so a command it cannot apply to fails at once.
//! The value it sets must be what the ranks saw as their micro-batch
//! (samples per forward): a global batch split over ranks or micro-batches
//! is not rewritten, and the verification says why it did not run.

use anyhow::Context as _;

use super::report::RankResult;

/// How the micro-batch size reaches the script.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BatchSetting {
    /// A command-line argument: `--NAME V`, `--NAME=V`, or `NAME=V` when the
    /// name has no leading dash.
    Arg(String),
    /// An environment variable.
    Env(String),
}

impl BatchSetting {
    /// From `--batch-arg` / `--batch-env` (clap keeps them exclusive).
    pub fn from_args(arg: Option<&str>, env: Option<&str>) -> anyhow::Result<Option<Self>> {
        let setting = match (arg, env) {
            (Some(a), _) => BatchSetting::Arg(a.to_string()),
            (None, Some(e)) => BatchSetting::Env(e.to_string()),
            (None, None) => return Ok(None),
        };
        match &setting {
            BatchSetting::Arg(a) => anyhow::ensure!(
                !a.trim_start_matches('-').is_empty() && !a.contains(['=', ' ']),
                "--batch-arg {a:?}: give the argument's name as the command spells it \
                 (--batch, or data.batch_size for a `data.batch_size=8` override)"
            ),
            BatchSetting::Env(e) => anyhow::ensure!(
                !e.is_empty() && !e.contains(['=', '\0']),
                "--batch-env {e:?} is not an environment variable's name"
            ),
        }
        Ok(Some(setting))
    }

    /// How a person reads it, with the value `n`: `--batch 2`, `MICRO_BATCH=2`.
    pub fn describe(&self, n: u64) -> String {
        match self {
            BatchSetting::Arg(a) if a.starts_with('-') => format!("{a} {n}"),
            BatchSetting::Arg(a) | BatchSetting::Env(a) => format!("{a}={n}"),
        }
    }

    /// The micro-batch size the command sets now; None for a variable that is
    /// not set (the script's default). An error when the command does not say
    /// it once, or says something that is not a whole number.
    pub fn current(&self, command: &[String]) -> anyhow::Result<Option<u64>> {
        match self {
            BatchSetting::Arg(_) => {
                let (i, len) = self.position(command)?;
                let value = &command[i + len - 1];
                let value = if len == 2 {
                    value.as_str()
                } else {
                    value.split_once('=').map_or("", |(_, v)| v)
                };
                parse(value, &self.describe(0)).map(Some)
            }
            BatchSetting::Env(name) => match std::env::var(name) {
                Ok(v) => parse(&v, name).map(Some),
                Err(std::env::VarError::NotPresent) => Ok(None),
                Err(e) => Err(e).with_context(|| format!("${name}")),
            },
        }
    }

    /// The command and the environment that set the micro-batch to `n`.
    pub fn apply(&self, command: &[String], n: u64) -> anyhow::Result<Applied> {
        let mut out = command.to_vec();
        match self {
            BatchSetting::Arg(a) => {
                let (i, len) = self.position(command)?;
                if len == 2 {
                    out[i + 1] = n.to_string();
                } else {
                    out[i] = format!("{a}={n}");
                }
                Ok(Applied {
                    command: out,
                    env: None,
                })
            }
            BatchSetting::Env(name) => Ok(Applied {
                command: out,
                env: Some((name.clone(), n.to_string())),
            }),
        }
    }

    /// Where the argument is in the command, as (index, words): 2 for
    /// `--batch 8`, 1 for `--batch=8` or `batch=8`.
    fn position(&self, command: &[String]) -> anyhow::Result<(usize, usize)> {
        let BatchSetting::Arg(a) = self else {
            unreachable!("only arguments have a position")
        };
        let joined = format!("{a}=");
        let found: Vec<(usize, usize)> = command
            .iter()
            .enumerate()
            .filter_map(|(i, w)| {
                if w.starts_with(&joined) {
                    Some((i, 1))
                } else if w == a && a.starts_with('-') {
                    Some((i, 2))
                } else {
                    None
                }
            })
            .collect();
        let spelled = if a.starts_with('-') {
            format!("`{a} N` or `{a}=N`")
        } else {
            format!("`{a}=N`")
        };
        match found.as_slice() {
            [] => anyhow::bail!(
                "--batch-arg {a}: the command has no {spelled} to rewrite; write the \
                 micro-batch size into the command (e.g. {})",
                self.describe(8)
            ),
            [(i, 2)] if i + 1 >= command.len() => {
                anyhow::bail!("--batch-arg {a}: the command ends before {a}'s value")
            }
            [one] => Ok(*one),
            _ => anyhow::bail!(
                "--batch-arg {a}: the command sets {a} {} times; preflight rewrites only \
                 one",
                found.len()
            ),
        }
    }
}

/// A command set to run at another micro-batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    pub command: Vec<String>,
    /// The variable to set for it, with `--batch-env`.
    pub env: Option<(String, String)>,
}

fn parse(value: &str, what: &str) -> anyhow::Result<u64> {
    value
        .trim()
        .parse::<u64>()
        .ok()
        .filter(|&n| n > 0)
        .with_context(|| {
            format!("{what}: {value:?} is not a micro-batch size (a whole number, at least 1)")
        })
}

/// The micro-batch to verify: the smallest any rank that ran out of memory
/// in step 2 was advised, with the size it was advised from. Err says why
/// there is nothing to verify.
pub fn advised(ranks: &[RankResult], usable: u64, current: Option<u64>) -> Result<Advice, String> {
    let step2: Vec<&RankResult> = ranks
        .iter()
        .filter(|r| r.verdict(usable) == super::report::Verdict::Oom(2))
        .collect();
    if step2.is_empty() {
        return Err("not needed: no rank ran out of memory in step 2".into());
    }
    let named: Vec<(u32, u64, u64)> = step2
        .iter()
        .filter_map(|r| {
            let fit = r.what_would_fit();
            Some((
                r.rank,
                fit["fits_with_micro_batch_size"].as_u64()?,
                fit["micro_batch_size"].as_u64()?,
            ))
        })
        .collect();
    let Some(&(_, to, from)) = named.iter().min_by_key(|&&(_, to, _)| to) else {
        return Err("the agent's advice names no micro-batch size (see the advisory)".into());
    };
    if let Some(now) = current {
        if let Some(&(rank, _, saw)) = named.iter().find(|&&(_, _, saw)| saw != now) {
            return Err(format!(
                "the command sets {now}, but rank {rank}'s micro-batches had {saw} samples: \
                 the setting must be the samples per forward on each rank"
            ));
        }
    }
    Ok(Advice {
        micro_batch_size: to,
        from_micro_batch_size: from,
    })
}

/// The micro-batch the agent advised, and the one it was advised instead of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Advice {
    pub micro_batch_size: u64,
    pub from_micro_batch_size: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    fn arg(a: &str) -> BatchSetting {
        BatchSetting::Arg(a.into())
    }

    #[test]
    fn an_argument_is_rewritten_in_each_spelling() {
        let cmd = words("torchrun --nproc-per-node 2 t.py --batch 8 --steps 3");
        assert_eq!(arg("--batch").current(&cmd).unwrap(), Some(8));
        let applied = arg("--batch").apply(&cmd, 5).unwrap();
        assert_eq!(
            applied.command,
            words("torchrun --nproc-per-node 2 t.py --batch 5 --steps 3")
        );
        assert_eq!(applied.env, None);
        let cmd = words("python t.py --batch=8");
        assert_eq!(arg("--batch").current(&cmd).unwrap(), Some(8));
        assert_eq!(
            arg("--batch").apply(&cmd, 3).unwrap().command,
            words("python t.py --batch=3")
        );
        let cmd = words("python t.py data.batch_size=16 trainer.steps=3");
        assert_eq!(arg("data.batch_size").current(&cmd).unwrap(), Some(16));
        assert_eq!(
            arg("data.batch_size").apply(&cmd, 4).unwrap().command,
            words("python t.py data.batch_size=4 trainer.steps=3")
        );
        // `--batch-size` is another argument, not `--batch`.
        let cmd = words("python t.py --batch-size 8 --batch 2");
        assert_eq!(arg("--batch").current(&cmd).unwrap(), Some(2));
    }

    #[test]
    fn a_command_it_cannot_rewrite_is_a_clear_error() {
        let err = |setting: BatchSetting, cmd: &str| {
            format!("{:#}", setting.current(&words(cmd)).unwrap_err())
        };
        let e = err(arg("--batch"), "python t.py --steps 3");
        assert!(
            e.contains("no `--batch N` or `--batch=N` to rewrite"),
            "{e}"
        );
        assert!(e.contains("--batch 8"), "{e}");
        let e = err(arg("--batch"), "python t.py --batch 8 --batch=4");
        assert!(e.contains("sets --batch 2 times"), "{e}");
        let e = err(arg("--batch"), "python t.py --batch");
        assert!(e.contains("ends before --batch's value"), "{e}");
        let e = err(arg("--batch"), "python t.py --batch eight");
        assert!(e.contains("\"eight\" is not a micro-batch size"), "{e}");
        let e = err(arg("--batch"), "python t.py --batch 0");
        assert!(e.contains("not a micro-batch size"), "{e}");
        // A bare name matches only its `name=` form.
        let e = err(arg("batch"), "python t.py batch 8");
        assert!(e.contains("no `batch=N`"), "{e}");
        assert!(BatchSetting::from_args(Some("--batch=8"), None).is_err());
        assert!(BatchSetting::from_args(Some("--"), None).is_err());
        assert!(BatchSetting::from_args(None, Some("A=B")).is_err());
        assert_eq!(BatchSetting::from_args(None, None).unwrap(), None);
    }

    #[test]
    fn an_environment_variable_is_set_for_the_run() {
        let setting = BatchSetting::Env("STEPWATCH_TEST_UNSET_MICRO_BATCH".into());
        let cmd = words("python t.py");
        assert_eq!(setting.current(&cmd).unwrap(), None);
        let applied = setting.apply(&cmd, 2).unwrap();
        assert_eq!(applied.command, cmd);
        assert_eq!(
            applied.env,
            Some(("STEPWATCH_TEST_UNSET_MICRO_BATCH".into(), "2".into()))
        );
        assert_eq!(setting.describe(2), "STEPWATCH_TEST_UNSET_MICRO_BATCH=2");
    }

    fn rank(n: u32, oom: Option<u64>, fit: serde_json::Value) -> RankResult {
        RankResult {
            rank: n,
            oom_step: oom,
            steps_completed: 3,
            steady_peak_bytes: Some(1),
            prediction: serde_json::json!({ "what_would_fit": fit }),
            ..Default::default()
        }
    }

    #[test]
    fn the_smallest_advice_of_the_ranks_that_died_in_step_2_is_verified() {
        let fit = |to: u64, from: u64| serde_json::json!({"fits_with_micro_batch_size": to, "micro_batch_size": from});
        let ranks = [
            rank(0, Some(2), fit(3, 4)),
            rank(1, Some(2), fit(2, 4)),
            rank(2, None, fit(1, 4)),
        ];
        assert_eq!(
            advised(&ranks, 100, Some(4)),
            Ok(Advice {
                micro_batch_size: 2,
                from_micro_batch_size: 4
            })
        );
        assert_eq!(advised(&ranks, 100, None).unwrap().micro_batch_size, 2);
        // The command's 16 is not what the ranks saw: a global batch.
        let e = advised(&ranks, 100, Some(16)).unwrap_err();
        assert!(
            e.contains("the command sets 16, but rank 0's micro-batches had 4"),
            "{e}"
        );
        let e = advised(&ranks[2..], 100, Some(4)).unwrap_err();
        assert!(e.starts_with("not needed"), "{e}");
        let none = [rank(
            0,
            Some(2),
            serde_json::json!({"micro_batch_size": null}),
        )];
        let e = advised(&none, 100, Some(4)).unwrap_err();
        assert!(e.contains("names no micro-batch size"), "{e}");
    }
}
