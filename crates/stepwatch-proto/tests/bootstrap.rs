//! Fails when the checked-in bindings in `src/generated/` are stale.
//!
//! The generated code is committed so that building stepwatch needs no
//! `protoc` (the tokio-console pattern). This test regenerates it with protox,
//! a pure-Rust protobuf compiler, and fails if anything changed; rerun
//! `cargo test -p stepwatch-proto` and commit the result.

use std::path::PathBuf;

#[test]
fn generated_code_is_up_to_date() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let proto_dir = root.join("../../proto");
    let out_dir = root.join("src/generated");
    let fds = protox::compile(["stepwatch/v1/ingest.proto"], [&proto_dir]).expect("proto compiles");

    let before = std::fs::read_to_string(out_dir.join("stepwatch.v1.rs")).unwrap_or_default();
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .emit_rerun_if_changed(false)
        .out_dir(&out_dir)
        .compile_fds(fds)
        .expect("code generation");
    let after = std::fs::read_to_string(out_dir.join("stepwatch.v1.rs")).unwrap();

    assert!(
        before == after,
        "src/generated/stepwatch.v1.rs was stale and has been regenerated; commit the change"
    );
}
