//! Builds libucm_core.so (the C ABI used by the Python package), runs the unit tests and the
//! seeded model-based fuzzers with `zig build test`, and the long run of a fuzzer picked by
//! name with `zig build fuzz -- buffer|queue --seed N --steps M`.
const std = @import("std");

pub fn build(b: *std.Build) void {
    const target = b.standardTargetOptions(.{});
    // ReleaseSafe keeps every assertion armed in the shipped library: a violated invariant in
    // shared memory must stop the process, not corrupt the other ranks.
    const optimize = b.standardOptimizeOption(.{ .preferred_optimize_mode = .ReleaseSafe });

    const lib_module = b.createModule(.{
        .root_source_file = b.path("src/exports.zig"),
        .target = target,
        .optimize = optimize,
        // libc: the native queue's threads are pthreads (the library lives in a glibc process,
        // whose TLS and signal handlers a raw clone() thread would break), and its copies call
        // the C library's memcpy, tuned per CPU.
        .link_libc = true,
    });
    // The `*_debug_*` exports (fault injection, slot introspection) exist only in a test
    // build of the library, `zig build -Ddebug-hooks=true` (`libucm_core_test.so`), never in
    // the release one.
    const debug_hooks = b.option(bool, "debug-hooks", "Export the *_debug_* test hooks (test build only)") orelse false;
    const lib_options = b.addOptions();
    lib_options.addOption(bool, "debug_hooks", debug_hooks);
    lib_module.addOptions("build_options", lib_options);
    const lib = b.addLibrary(.{
        .name = if (debug_hooks) "ucm_core_test" else "ucm_core",
        .linkage = .dynamic,
        .root_module = lib_module,
    });
    b.installArtifact(lib);

    const test_step = b.step("test", "Run unit tests and seeded fuzzers");
    const test_roots = [_][]const u8{"src/tests.zig"};
    for (test_roots) |root| {
        const test_module = b.createModule(.{
            .root_source_file = b.path(root),
            .target = target,
            .optimize = .Debug,
            .link_libc = true,
        });
        const test_options = b.addOptions();
        test_options.addOption(bool, "debug_hooks", true);
        test_module.addOptions("build_options", test_options);
        // LLVM: the self-hosted x86_64 backend of Debug builds cannot assemble the queue's
        // non-temporal copy (inline assembly with memory operands).
        const unit_tests = b.addTest(.{ .root_module = test_module, .use_llvm = true });
        const run_tests = b.addRunArtifact(unit_tests);
        test_step.dependOn(&run_tests.step);
    }

    // The long form of the fuzzers (fuzz_main.zig picks one by name). ReleaseSafe unless asked otherwise: every
    // assertion stays armed, and a long run goes several times faster than in Debug.
    const fuzz_optimize = b.option(
        std.builtin.OptimizeMode,
        "fuzz-optimize",
        "Optimize mode of `zig build fuzz` (default ReleaseSafe)",
    ) orelse .ReleaseSafe;
    const fuzz_module = b.createModule(.{
        .root_source_file = b.path("src/fuzz_main.zig"),
        .target = target,
        .optimize = fuzz_optimize,
        .link_libc = true, // the queue fuzzer runs the queue's pthreads and memcpy
    });
    const fuzz_exe = b.addExecutable(.{ .name = "ucm-fuzz", .root_module = fuzz_module });
    const run_fuzz = b.addRunArtifact(fuzz_exe);
    if (b.args) |args| run_fuzz.addArgs(args);
    const fuzz_step = b.step("fuzz", "Run a fuzzer: zig build fuzz -- buffer|queue --seed N --steps M");
    fuzz_step.dependOn(&run_fuzz.step);

    // `zig build abi -- PATH`: writes the Python mirror of the C ABI (ucm/native/_abi.py).
    const abi_module = b.createModule(.{
        .root_source_file = b.path("src/abi_gen.zig"),
        .target = target,
        .optimize = .Debug,
        .link_libc = true,
    });
    // The generator reflects over exports.zig, the debug hooks included (they are plain
    // functions there; only the test build exports them).
    const abi_options = b.addOptions();
    abi_options.addOption(bool, "debug_hooks", false);
    abi_module.addOptions("build_options", abi_options);
    // LLVM: exports.zig pulls in the queue's inline-assembly copy (see the unit tests).
    const abi_exe = b.addExecutable(.{ .name = "ucm-abi-gen", .root_module = abi_module, .use_llvm = true });
    const run_abi = b.addRunArtifact(abi_exe);
    if (b.args) |args| run_abi.addArgs(args);
    const abi_step = b.step("abi", "Write the Python mirror of the C ABI: zig build abi -- PATH");
    abi_step.dependOn(&run_abi.step);
}
