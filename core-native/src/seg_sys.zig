//! Small Linux helpers shared by the segment layer (shm.zig, memfd.zig, fdpass.zig): error
//! reporting into a caller-provided buffer, process liveness from /proc, statfs, names.
//!
//! Every failure is reported as a Zig error plus a human sentence in `Diag`, because the Python
//! binding turns the sentence into the exception message: it must say what went wrong, the
//! values involved and what to change.
const std = @import("std");
const linux = std.os.linux;
const constants = @import("constants.zig");

const assert = std.debug.assert;

pub const SegError = error{
    /// A caller argument is out of range; nothing was touched.
    InvalidArgument,
    /// An existing segment cannot be used: wrong magic, layout version or geometry.
    Mismatch,
    /// Not enough shared memory for the requested capacity.
    NoSpace,
    /// A bounded wait (creation lock, fd hand-over) ran out.
    Timeout,
    /// Permission denied: the segment belongs to another user, or a peer refused us.
    Permission,
    /// Any other system call failure.
    System,
};

/// Negative return codes of the C ABI, one per `SegError`. `invalid_argument` matches
/// `exports.Error.invalid_argument`.
pub fn error_code(err: SegError) i32 {
    return switch (err) {
        error.InvalidArgument => -1,
        error.Mismatch => -20,
        error.NoSpace => -21,
        error.Timeout => -22,
        error.Permission => -23,
        error.System => -24,
    };
}

/// A sentence describing the last failure, written into memory the caller owns. A zero-length
/// buffer is valid (the message is dropped).
pub const Diag = struct {
    buffer: []u8,
    len: usize = 0,

    pub fn init(buffer: []u8) Diag {
        return .{ .buffer = buffer };
    }

    /// Records the message and returns `err`, so call sites read `return diag.fail(...)`.
    pub fn fail(self: *Diag, err: SegError, comptime fmt: []const u8, args: anytype) SegError {
        self.record(fmt, args);
        return err;
    }

    pub fn record(self: *Diag, comptime fmt: []const u8, args: anytype) void {
        assert(self.len <= self.buffer.len);
        if (self.buffer.len == 0) return;
        // The last byte stays free for the NUL terminator the C side expects.
        const room = self.buffer[0 .. self.buffer.len - 1];
        const written = std.fmt.bufPrint(room, fmt, args) catch room;
        self.len = written.len;
        self.buffer[self.len] = 0;
        assert(self.len < self.buffer.len);
    }

    pub fn message(self: *const Diag) []const u8 {
        assert(self.len <= self.buffer.len);
        return self.buffer[0..self.len];
    }
};

/// The errno of a raw syscall result, `.SUCCESS` when it succeeded.
pub fn errno(rc: usize) linux.E {
    return linux.E.init(rc);
}

pub fn close_fd(fd: i32) void {
    assert(fd >= 0);
    // close() never needs retrying on Linux: the descriptor is gone even on EINTR.
    _ = linux.close(fd);
}

pub fn sleep_ns(duration_ns: u64) void {
    assert(duration_ns > 0);
    assert(duration_ns < std.time.ns_per_s);
    const ts = linux.timespec{ .sec = 0, .nsec = @intCast(duration_ns) };
    _ = linux.nanosleep(&ts, null);
}

extern "c" fn sigfillset(set: *std.c.sigset_t) c_int;

/// Blocks every signal in the calling (native, pthread) thread: signals meant for the process
/// go to its own threads, and glibc keeps the few it reserves (pthread_sigmask filters them).
pub fn block_signals() void {
    var all: std.c.sigset_t = undefined;
    assert(sigfillset(&all) == 0);
    var previous: std.c.sigset_t = undefined;
    assert(std.c.pthread_sigmask(linux.SIG.BLOCK, &all, &previous) == 0);
}

pub fn monotonic_ns() u64 {
    var ts: linux.timespec = undefined;
    const rc = linux.clock_gettime(.MONOTONIC, &ts);
    assert(errno(rc) == .SUCCESS);
    assert(ts.sec >= 0);
    return @as(u64, @intCast(ts.sec)) * std.time.ns_per_s + @as(u64, @intCast(ts.nsec));
}

/// The identity of a live process: the pid alone is reused by the kernel, the pair with the
/// start time (clock ticks after boot, /proc/<pid>/stat field 22) is not.
pub const ProcessId = struct {
    pid: u32,
    start_time_ticks: u64,
};

pub fn self_identity() ProcessId {
    const pid: u32 = @intCast(linux.getpid());
    assert(pid > 0);
    const start = process_start_time_ticks(pid) orelse
        std.debug.panic("cannot read /proc/self stat of pid {d}", .{pid});
    return .{ .pid = pid, .start_time_ticks = start };
}

/// True when `identity` names a running process (not a zombie, not a reused pid).
pub fn process_alive(identity: ProcessId) bool {
    assert(identity.pid != 0);
    const start = process_start_time_ticks(identity.pid) orelse return false;
    return start == identity.start_time_ticks;
}

/// Field 22 of /proc/<pid>/stat, or null when the process does not exist or is a zombie
/// (a SIGKILLed child that its parent has not reaped yet still has a stat file).
pub fn process_start_time_ticks(pid: u32) ?u64 {
    assert(pid != 0);
    var path_buffer: [64]u8 = undefined;
    const path = std.fmt.bufPrintZ(&path_buffer, "/proc/{d}/stat", .{pid}) catch unreachable;
    const open_rc = linux.open(path, .{ .ACCMODE = .RDONLY, .CLOEXEC = true }, 0);
    if (errno(open_rc) != .SUCCESS) return null;
    const fd: i32 = @intCast(open_rc);
    defer close_fd(fd);
    var stat_buffer: [1024]u8 = undefined;
    const read_rc = linux.read(fd, &stat_buffer, stat_buffer.len);
    if (errno(read_rc) != .SUCCESS) return null;
    return parse_stat_start_time(stat_buffer[0..read_rc]);
}

/// Parses "pid (comm) state f4 ... f22 ...". comm may hold spaces and parentheses, so fields
/// are counted from the last ')'.
pub fn parse_stat_start_time(text: []const u8) ?u64 {
    assert(text.len <= 4096);
    const close_paren = std.mem.lastIndexOfScalar(u8, text, ')') orelse return null;
    var fields = std.mem.tokenizeScalar(u8, text[close_paren + 1 ..], ' ');
    // Field 3 is the state; fields 4..22 follow. The loop is bounded by the 20 fields we need.
    const state = fields.next() orelse return null;
    if (state.len != 1) return null;
    if (state[0] == 'Z' or state[0] == 'X') return null;
    var field_index: u32 = 4;
    while (field_index < 22) : (field_index += 1) {
        _ = fields.next() orelse return null;
    }
    const start_field = fields.next() orelse return null;
    return std.fmt.parseInt(u64, std.mem.trimRight(u8, start_field, "\n"), 10) catch null;
}

/// struct statfs as the 64-bit kernels lay it out (x86_64, aarch64: every word is 64-bit).
const Statfs = extern struct {
    type: i64,
    bsize: i64,
    blocks: u64,
    bfree: u64,
    bavail: u64,
    files: u64,
    ffree: u64,
    fsid: [2]i32,
    namelen: i64,
    frsize: i64,
    flags: i64,
    spare: [4]i64,
};

comptime {
    assert(@sizeOf(usize) == 8);
    assert(@sizeOf(Statfs) == 120);
}

/// Bytes an unprivileged writer may still allocate on the file system holding `path`.
pub fn available_bytes(path: [*:0]const u8) ?u64 {
    var buffer: Statfs = undefined;
    const rc = linux.syscall2(.statfs, @intFromPtr(path), @intFromPtr(&buffer));
    if (errno(rc) != .SUCCESS) return null;
    assert(buffer.bsize > 0);
    return buffer.bavail *| @as(u64, @intCast(buffer.bsize));
}

/// A unique id names files under /dev/shm and an abstract socket: a short, safe charset.
pub fn unique_id_valid(unique_id: []const u8) bool {
    if (unique_id.len == 0 or unique_id.len > constants.seg_unique_id_max_bytes) return false;
    if (unique_id[0] == '.' or unique_id[0] == '-') return false;
    for (unique_id) |c| {
        const ok = std.ascii.isAlphanumeric(c) or c == '_' or c == '-' or c == '.';
        if (!ok) return false;
    }
    return true;
}

pub const PathBuffer = [constants.seg_path_max_bytes]u8;

/// "/dev/shm/ucm-<unique_id><suffix>", NUL-terminated.
pub fn shm_path(buffer: *PathBuffer, unique_id: []const u8, suffix: []const u8) [:0]const u8 {
    assert(unique_id_valid(unique_id));
    assert(suffix.len < 16);
    return std.fmt.bufPrintZ(buffer, "{s}/ucm-{s}{s}", .{
        constants.seg_shm_dir,
        unique_id,
        suffix,
    }) catch unreachable;
}

test "parse_stat_start_time handles a comm with spaces and parentheses" {
    const line = "4242 (a b) c)) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 987654 20 21\n";
    try std.testing.expectEqual(@as(?u64, 987654), parse_stat_start_time(line));
    const zombie = "4242 (x) Z 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 987654 20 21\n";
    try std.testing.expectEqual(@as(?u64, null), parse_stat_start_time(zombie));
    try std.testing.expectEqual(@as(?u64, null), parse_stat_start_time("12 (short) S 1 2"));
}

test "self is alive and a reused pid with another start time is not" {
    const me = self_identity();
    try std.testing.expect(process_alive(me));
    try std.testing.expect(!process_alive(.{ .pid = me.pid, .start_time_ticks = me.start_time_ticks + 1 }));
}

test "unique ids are checked" {
    try std.testing.expect(unique_id_valid("run-42.a_b"));
    try std.testing.expect(!unique_id_valid(""));
    try std.testing.expect(!unique_id_valid("../etc"));
    try std.testing.expect(!unique_id_valid("a/b"));
    try std.testing.expect(!unique_id_valid("a" ** (constants.seg_unique_id_max_bytes + 1)));
}

test "Diag keeps the message NUL-terminated and truncates" {
    var buffer: [8]u8 = undefined;
    var diag = Diag.init(&buffer);
    try std.testing.expectEqual(error.System, diag.fail(error.System, "{s}", .{"0123456789"}));
    try std.testing.expectEqualStrings("0123456", diag.message());
    try std.testing.expectEqual(@as(u8, 0), buffer[7]);
}
