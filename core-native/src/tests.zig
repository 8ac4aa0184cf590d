//! Root of `zig build test`: pulls in every module's unit tests and the fuzzers.
comptime {
    _ = @import("constants.zig");
    _ = @import("futex.zig");
    _ = @import("exports.zig");
}
