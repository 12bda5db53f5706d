//! What the agent image carries: built as deploy/Dockerfile builds it
//! (`--no-default-features`), the binary depends on none of the development
//! tools (simulator, fake NVML, the Rust client the simulator talks through,
//! the HTTP client the demo reads the agent with).

mod common;

use std::process::Command;

use common::stdout_of;

const DEV_ONLY: [&str; 5] = [
    "stepwatch-sim",
    "fake-nvml",
    "stepwatch-client",
    "signal-hook",
    "ureq",
];

/// The crates the binary is built from with these cargo flags.
fn normal_dependencies(features: &[&str]) -> Vec<String> {
    let tree = stdout_of(
        Command::new(env!("CARGO"))
            .args([
                "tree",
                "-p",
                "stepwatch",
                "-e",
                "normal",
                "--prefix",
                "none",
            ])
            .args(["--offline", "--locked"])
            .args(features)
            .current_dir(env!("CARGO_MANIFEST_DIR")),
        "cargo tree",
    );
    tree.lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect()
}

#[test]
fn the_agent_image_build_has_no_development_tools() {
    let agent = normal_dependencies(&["--no-default-features"]);
    assert!(agent.iter().any(|c| c == "stepwatch-agent"), "{agent:?}");
    for dev in DEV_ONLY {
        assert!(!agent.iter().any(|c| c == dev), "{dev} in {agent:?}");
    }
    // The default build (cargo run -- demo, the tests) has them.
    let full = normal_dependencies(&[]);
    for dev in DEV_ONLY {
        assert!(full.iter().any(|c| c == dev), "{dev} not in {full:?}");
    }
    // And the image is built that way, stripped.
    let dockerfile =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/Dockerfile")).unwrap();
    let build = dockerfile
        .lines()
        .find(|l| l.contains("cargo build"))
        .expect("deploy/Dockerfile runs cargo build");
    assert!(build.contains("--no-default-features"), "{build}");
    // With every optional component of the agent, as the default build.
    assert!(build.contains("--features components"), "{build}");
    assert!(
        dockerfile.contains("CARGO_PROFILE_RELEASE_STRIP=symbols"),
        "the image's binary is not stripped"
    );
}
