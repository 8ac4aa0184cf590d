//! Root of `zig build test`: pulls in every module's unit tests and the fuzzers.
comptime {
    _ = @import("constants.zig");
    _ = @import("futex.zig");
    _ = @import("checksum.zig");
    _ = @import("exports.zig");
    _ = @import("buffer.zig"); // CacheBuffer
    _ = @import("removal_log.zig"); // purges and forced removes, for writers
    _ = @import("buffer_fuzz.zig"); // CacheBuffer model-based fuzzer
    _ = @import("queue.zig"); // native load queue
    _ = @import("queue_test.zig"); // its tests
    _ = @import("queue_fuzz.zig"); // its model-based fuzzer
    _ = @import("abi_gen.zig"); // `zig build abi`: the generated Python mirror of the ABI
    _ = @import("fuzz_main.zig"); // `zig build fuzz`: its argument parsing
    _ = @import("seg_sys.zig");
    _ = @import("shm.zig");
    _ = @import("memfd.zig");
    _ = @import("populate.zig");
    _ = @import("fdpass.zig");
    _ = @import("seg_region.zig");
}
