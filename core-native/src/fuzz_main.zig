//! `zig build fuzz -- FUZZER --seed N --steps M`: the long form of a fuzzer, picked by name
//! (as TigerBeetle's fuzz_tests.zig does), the same model and operations as `zig build test`
//! runs, for as many steps as asked:
//! - `buffer`: the CacheBuffer control plane (`buffer_fuzz.zig`); M steps.
//! - `queue`: the native load queue over a buffer and over a null buffer (`queue_fuzz.zig`);
//!   M rounds (tasks).
//! A failure prints the seed (and for `buffer` the step and the last operations); the same
//! arguments replay it.
const std = @import("std");
const buffer_fuzz = @import("buffer_fuzz.zig");
const queue_fuzz = @import("queue_fuzz.zig");

const usage = "usage: zig build fuzz -- buffer|queue --seed N --steps M   (N, M: unsigned decimal integers, M >= 1)";

pub const Fuzzer = enum { buffer, queue };

pub const Arguments = struct { fuzzer: Fuzzer, seed: u64, steps: u64 };

pub const ParseError = error{InvalidArguments};

/// Parses `FUZZER --seed N --steps M` (the fuzzer's name first; the options in either order,
/// `--name=value` too). On an error writes a message naming the argument and the value into
/// `message` and returns InvalidArguments.
pub fn parse_arguments(arguments: []const []const u8, message: *[256]u8, message_len: *usize) ParseError!Arguments {
    if (arguments.len == 0 or std.mem.startsWith(u8, arguments[0], "--")) {
        return fail(message, message_len, "name the fuzzer first (buffer or queue); {s}", .{usage});
    }
    const fuzzer = std.meta.stringToEnum(Fuzzer, arguments[0]) orelse {
        return fail(message, message_len, "unknown fuzzer '{s}': expected buffer or queue; {s}", .{ arguments[0], usage });
    };
    var seed: ?u64 = null;
    var steps: ?u64 = null;
    var index: usize = 1;
    while (index < arguments.len) : (index += 1) {
        const argument = arguments[index];
        var name = argument;
        var value: ?[]const u8 = null;
        if (std.mem.indexOfScalar(u8, argument, '=')) |equals| {
            name = argument[0..equals];
            value = argument[equals + 1 ..];
        }
        const is_seed = std.mem.eql(u8, name, "--seed");
        const is_steps = std.mem.eql(u8, name, "--steps");
        if (!is_seed and !is_steps) {
            return fail(message, message_len, "unknown argument '{s}'; {s}", .{ argument, usage });
        }
        if (value == null) {
            index += 1;
            if (index == arguments.len) return fail(message, message_len, "{s} needs a value; {s}", .{ name, usage });
            value = arguments[index];
        }
        const number = std.fmt.parseInt(u64, value.?, 10) catch {
            return fail(message, message_len, "{s} '{s}' is not an unsigned 64-bit decimal integer; {s}", .{ name, value.?, usage });
        };
        if (is_seed) {
            if (seed != null) return fail(message, message_len, "--seed given twice; {s}", .{usage});
            seed = number;
        } else {
            if (steps != null) return fail(message, message_len, "--steps given twice; {s}", .{usage});
            if (number == 0) return fail(message, message_len, "--steps 0 runs nothing: give at least 1; {s}", .{usage});
            steps = number;
        }
    }
    if (seed == null) return fail(message, message_len, "--seed is missing; {s}", .{usage});
    if (steps == null) return fail(message, message_len, "--steps is missing; {s}", .{usage});
    return .{ .fuzzer = fuzzer, .seed = seed.?, .steps = steps.? };
}

fn fail(message: *[256]u8, message_len: *usize, comptime format: []const u8, args: anytype) ParseError {
    const text = std.fmt.bufPrint(message, format, args) catch message[0..];
    message_len.* = text.len;
    return error.InvalidArguments;
}

pub fn main() !u8 {
    var arguments_buffer: [16][]const u8 = undefined;
    var arguments_count: usize = 0;
    var iterator = std.process.args();
    _ = iterator.skip(); // the program name
    while (iterator.next()) |argument| {
        if (arguments_count == arguments_buffer.len) {
            std.debug.print("too many arguments; {s}\n", .{usage});
            return 2;
        }
        arguments_buffer[arguments_count] = argument;
        arguments_count += 1;
    }
    var message: [256]u8 = undefined;
    var message_len: usize = 0;
    const arguments = parse_arguments(arguments_buffer[0..arguments_count], &message, &message_len) catch {
        std.debug.print("{s}\n", .{message[0..message_len]});
        return 2;
    };
    const start_ns = std.time.nanoTimestamp();
    switch (arguments.fuzzer) {
        .buffer => {
            std.debug.print("buffer fuzz: seed {d}, steps {d}\n", .{ arguments.seed, arguments.steps });
            const summary = buffer_fuzz.run(arguments.seed, arguments.steps) catch return 1;
            const elapsed_ns: u64 = @intCast(std.time.nanoTimestamp() - start_ns);
            std.debug.print("buffer fuzz: passed: seed {d}, {d} steps in {d} epochs, {d} ms\n", .{
                arguments.seed, summary.steps, summary.epochs, elapsed_ns / std.time.ns_per_ms,
            });
            buffer_fuzz.print_coverage(&summary);
        },
        .queue => {
            std.debug.print("queue fuzz: seed {d}, rounds {d}\n", .{ arguments.seed, arguments.steps });
            const summary = queue_fuzz.run(arguments.seed, arguments.steps) catch |err| {
                std.debug.print("queue fuzz: FAILED: seed {d}: {s}\n", .{ arguments.seed, @errorName(err) });
                return 1;
            };
            const elapsed_ns: u64 = @intCast(std.time.nanoTimestamp() - start_ns);
            std.debug.print("queue fuzz: passed: seed {d}, {d} rounds, {d} ms\n", .{
                arguments.seed, summary.rounds, elapsed_ns / std.time.ns_per_ms,
            });
            queue_fuzz.print_summary(&summary);
        },
    }
    return 0;
}

fn expect_error(arguments: []const []const u8, expected_message: []const u8) !void {
    var message: [256]u8 = undefined;
    var message_len: usize = 0;
    try std.testing.expectError(error.InvalidArguments, parse_arguments(arguments, &message, &message_len));
    try std.testing.expect(std.mem.startsWith(u8, message[0..message_len], expected_message));
}

test "fuzz arguments: the fuzzer by name, --seed and --steps in either order and with '='" {
    var message: [256]u8 = undefined;
    var message_len: usize = 0;
    const parsed = try parse_arguments(&.{ "buffer", "--steps", "2000000", "--seed", "7" }, &message, &message_len);
    try std.testing.expectEqual(Arguments{ .fuzzer = .buffer, .seed = 7, .steps = 2_000_000 }, parsed);
    const with_equals = try parse_arguments(&.{ "queue", "--seed=18446744073709551615", "--steps=1" }, &message, &message_len);
    try std.testing.expectEqual(Arguments{ .fuzzer = .queue, .seed = std.math.maxInt(u64), .steps = 1 }, with_equals);
}

test "fuzz arguments: errors name the argument and the value" {
    try expect_error(&.{ "buffer", "--seed", "7" }, "--steps is missing; usage: zig build fuzz -- buffer|queue --seed N --steps M");
    try expect_error(&.{ "queue", "--steps", "9" }, "--seed is missing");
    try expect_error(&.{ "buffer", "--seed", "x7", "--steps", "9" }, "--seed 'x7' is not an unsigned 64-bit decimal integer");
    try expect_error(&.{ "buffer", "--seed", "-1", "--steps", "9" }, "--seed '-1' is not an unsigned 64-bit decimal integer");
    try expect_error(&.{ "queue", "--seed", "1", "--steps", "0" }, "--steps 0 runs nothing: give at least 1");
    try expect_error(&.{ "buffer", "--seed", "1", "--steps" }, "--steps needs a value");
    try expect_error(&.{ "buffer", "--seed", "1", "--seed", "2", "--steps", "3" }, "--seed given twice");
    try expect_error(&.{ "buffer", "--sed", "1" }, "unknown argument '--sed'");
    try expect_error(&.{ "--seed", "1", "--steps", "2" }, "name the fuzzer first (buffer or queue)");
    try expect_error(&.{}, "name the fuzzer first (buffer or queue)");
    try expect_error(&.{ "queues", "--seed", "1" }, "unknown fuzzer 'queues': expected buffer or queue");
}
