//! Fails when the checked-in bindings are stale: `src/generated/` for our
//! own contract, `src/third_party/` for the upstream APIs of
//! `proto/third_party/`, kept apart as their sources are.
//!
//! The generated code is committed so that building stepwatch needs no
//! `protoc` (the tokio-console pattern). This test regenerates it with protox,
//! a pure-Rust protobuf compiler, and fails if anything changed; rerun
//! `cargo test -p stepwatch-proto` and commit the result.

use std::path::PathBuf;

#[test]
fn generated_code_is_up_to_date() {
    regenerate("stepwatch/v1/ingest.proto", "generated", "stepwatch.v1.rs");
}

/// The kubelet's pod-resources API (vendored, see the file's header): the
/// client is the agent's, the server the fake kubelet of the tests.
#[test]
fn generated_pod_resources_code_is_up_to_date() {
    regenerate("kubelet/podresources/v1/api.proto", "third_party", "v1.rs");
}

/// The CSI spec (vendored, see the file's header): the agent serves its
/// Identity and Node services with `--csi-socket`; the tests are the kubelet.
#[test]
fn generated_csi_code_is_up_to_date() {
    regenerate("csi/v1/csi.proto", "third_party", "csi.v1.rs");
}

fn regenerate(proto: &str, dir: &str, generated: &str) {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    // Upstream APIs, copied verbatim, live apart in proto/third_party/.
    let include = [
        root.join("../../proto"),
        root.join("../../proto/third_party"),
    ];
    let out_dir = root.join("src").join(dir);
    let fds = protox::compile([proto], include).expect("proto compiles");

    let before = std::fs::read_to_string(out_dir.join(generated)).unwrap_or_default();
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .emit_rerun_if_changed(false)
        .out_dir(&out_dir)
        .compile_fds(fds)
        .expect("code generation");
    let after = std::fs::read_to_string(out_dir.join(generated)).unwrap();

    assert!(
        before == after,
        "src/{dir}/{generated} was stale and has been regenerated; commit the change"
    );
}
