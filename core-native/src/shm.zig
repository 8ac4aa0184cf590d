//! The named control segment of a buffer: /dev/shm/ucm-<unique_id>.ctrl, mode 0600.
//!
//! Layout of the file (offsets in bytes):
//!   0 .. 4096            segment Header (below), owned by this module
//!   4096 .. 4096+ctrl    the caller's control region (BufferCtrl), page-rounded
//!
//! Header offsets (comptime-checked below): 0 magic u64 "UCM-SEG1", 8 layout_version u32,
//! 12 header_bytes u32, 16 ctrl_layout_version u32 (the caller's own layout version),
//! 20 segment_count u32, 24 ctrl_bytes u64, 32 data_bytes u64, 40 segment_bytes u64,
//! 48 creator_pid u32, 52 creator_uid u32, 56 creator_start_time_ticks u64, 64 huge_pages u32,
//! 68 hugetlb_fallback u32, 72 unique_id_len u32, 128 attach table: 64 entries of 16 bytes
//! {pid u32 (0 = free), flags u32 (bit 0: serves the data fds), start_time_ticks u64},
//! 1152 unique_id [64]u8.
//!
//! Start-up protocol. Creation, attach and stale replacement all run under an exclusive flock
//! on /dev/shm/ucm-<unique_id>.lock (the kernel drops it when its holder dies, so a killed
//! creator never blocks the others). The creator builds the segment under the temporary name
//! ucm-<unique_id>.ctrl.init, sizes it, writes the header, lets the caller initialise the
//! control region, and only then publishes it with link() to the final name. Nobody can map a
//! segment before it is sized and initialised, and the loser of a race attaches to the winner's
//! segment whatever the start order. A published segment whose attach table holds no live
//! process serving the data (creator and ranks all dead, /proc start times compared) is stale:
//! the next opener unlinks and replaces it.
const std = @import("std");
const linux = std.os.linux;
const constants = @import("constants.zig");
const sys = @import("seg_sys.zig");

const assert = std.debug.assert;
const SegError = sys.SegError;
const Diag = sys.Diag;

pub const entry_flag_serves_data: u32 = 1;

pub const AttachEntry = extern struct {
    /// 0 when free. Stored last with release ordering so that a reader that sees the pid
    /// (acquire) also sees flags and start time.
    pid: u32,
    flags: u32,
    start_time_ticks: u64,
};

pub const Header = extern struct {
    magic: u64,
    layout_version: u32,
    header_bytes: u32,
    ctrl_layout_version: u32,
    segment_count: u32,
    ctrl_bytes: u64,
    data_bytes: u64,
    segment_bytes: u64,
    creator_pid: u32,
    creator_uid: u32,
    creator_start_time_ticks: u64,
    huge_pages: u32,
    hugetlb_fallback: u32,
    unique_id_len: u32,
    reserved_word: u32,
    reserved: [48]u8,
    attach: [constants.seg_attach_entries_max]AttachEntry,
    unique_id: [constants.seg_unique_id_max_bytes]u8,
};

comptime {
    assert(@sizeOf(AttachEntry) == 16);
    assert(@offsetOf(Header, "magic") == 0);
    assert(@offsetOf(Header, "layout_version") == 8);
    assert(@offsetOf(Header, "ctrl_layout_version") == 16);
    assert(@offsetOf(Header, "ctrl_bytes") == 24);
    assert(@offsetOf(Header, "creator_pid") == 48);
    assert(@offsetOf(Header, "creator_start_time_ticks") == 56);
    assert(@offsetOf(Header, "huge_pages") == 64);
    assert(@offsetOf(Header, "attach") == 128);
    assert(@offsetOf(Header, "unique_id") == 1152);
    assert(@sizeOf(Header) <= constants.seg_header_bytes);
}

pub const Geometry = struct {
    ctrl_bytes: u64,
    data_bytes: u64,
    segment_bytes: u64,
    ctrl_layout_version: u32,

    pub fn segment_count(self: Geometry) u32 {
        assert(self.segment_bytes > 0);
        assert(self.data_bytes % self.segment_bytes == 0);
        return @intCast(self.data_bytes / self.segment_bytes);
    }
};

/// Bytes of the control file: header page plus the page-rounded control region.
pub fn ctrl_file_bytes(ctrl_bytes: u64) u64 {
    assert(ctrl_bytes > 0);
    assert(ctrl_bytes <= constants.seg_ctrl_bytes_max);
    return constants.seg_header_bytes + std.mem.alignForward(u64, ctrl_bytes, constants.seg_page_bytes);
}

const lock_exclusive: i32 = 2;
const lock_non_blocking: i32 = 4;
const lock_unlock: i32 = 8;

pub const Lock = struct {
    fd: i32,

    pub fn release(self: *Lock) void {
        assert(self.fd >= 0);
        _ = linux.flock(self.fd, lock_unlock);
        sys.close_fd(self.fd);
        self.fd = -1;
        assert(self.fd == -1);
    }
};

/// Takes the creation lock of `unique_id`, polling until `deadline_ns` (monotonic).
pub fn lock_acquire(unique_id: []const u8, deadline_ns: u64, diag: *Diag) SegError!Lock {
    assert(sys.unique_id_valid(unique_id));
    var path_buffer: sys.PathBuffer = undefined;
    const path = sys.shm_path(&path_buffer, unique_id, ".lock");
    // Bounded by the deadline: every pass sleeps seg_lock_poll_ns or returns.
    var passes: u64 = 0;
    while (true) : (passes += 1) {
        assert(passes < std.math.maxInt(u32));
        const open_rc = linux.open(path, .{ .ACCMODE = .RDWR, .CREAT = true, .CLOEXEC = true, .NOFOLLOW = true }, 0o600);
        switch (sys.errno(open_rc)) {
            .SUCCESS => {},
            .ACCES, .PERM => return diag.fail(error.Permission, "cannot open the lock file {s}: permission denied (it belongs to another user; segments are owner-only, mode 0600)", .{path}),
            else => |err| return diag.fail(error.System, "cannot open the lock file {s}: {s}", .{ path, @tagName(err) }),
        }
        const fd: i32 = @intCast(open_rc);
        // umask may have removed bits but never adds any; fchmod pins the mode to 0600.
        _ = linux.fchmod(fd, 0o600);
        const flock_rc = linux.flock(fd, lock_exclusive | lock_non_blocking);
        if (sys.errno(flock_rc) == .SUCCESS) {
            // The file may have been unlinked (cleanup) between our open and flock: the lock
            // only counts when the name still refers to the inode we locked.
            if (same_inode(fd, path)) return .{ .fd = fd };
        }
        sys.close_fd(fd);
        if (sys.monotonic_ns() >= deadline_ns) {
            return diag.fail(error.Timeout, "timed out waiting for the creation lock {s}: another process is creating the segments of unique_id {s} (a large capacity takes long to pre-fault); raise the open timeout", .{ path, unique_id });
        }
        sys.sleep_ns(constants.seg_lock_poll_ns);
    }
}

/// Non-blocking variant for close(): null when someone else holds the lock.
pub fn lock_try(unique_id: []const u8) ?Lock {
    var diag_buffer: [0]u8 = .{};
    var diag = Diag.init(&diag_buffer);
    const deadline_ns = sys.monotonic_ns() + constants.seg_close_lock_ns;
    return lock_acquire(unique_id, deadline_ns, &diag) catch null;
}

fn same_inode(fd: i32, path: [*:0]const u8) bool {
    var by_fd: linux.Stat = undefined;
    var by_path: linux.Stat = undefined;
    if (sys.errno(linux.fstat(fd, &by_fd)) != .SUCCESS) return false;
    if (sys.errno(linux.fstatat(linux.AT.FDCWD, path, &by_path, linux.AT.SYMLINK_NOFOLLOW)) != .SUCCESS) return false;
    return by_fd.ino == by_path.ino and by_fd.dev == by_path.dev;
}

/// A mapped control segment.
pub const Ctrl = struct {
    base: usize,
    file_bytes: usize,
    ino: u64,
    dev: u64,

    pub fn header(self: *const Ctrl) *Header {
        assert(self.base != 0);
        assert(self.base % constants.seg_page_bytes == 0);
        return @ptrFromInt(self.base);
    }

    pub fn region_address(self: *const Ctrl) usize {
        assert(self.file_bytes > constants.seg_header_bytes);
        return self.base + constants.seg_header_bytes;
    }

    pub fn unmap(self: *Ctrl) void {
        assert(self.base != 0);
        _ = linux.munmap(@ptrFromInt(self.base), self.file_bytes);
        self.base = 0;
    }
};

fn map_fd(fd: i32, file_bytes: usize, diag: *Diag, path: []const u8) SegError!Ctrl {
    assert(fd >= 0);
    assert(file_bytes >= constants.seg_header_bytes);
    var st: linux.Stat = undefined;
    if (sys.errno(linux.fstat(fd, &st)) != .SUCCESS) return diag.fail(error.System, "cannot stat {s}", .{path});
    const rc = linux.mmap(null, file_bytes, linux.PROT.READ | linux.PROT.WRITE, .{ .TYPE = .SHARED }, fd, 0);
    if (sys.errno(rc) != .SUCCESS) {
        return diag.fail(error.System, "cannot map the control segment {s} ({d} bytes): {s}", .{ path, file_bytes, @tagName(sys.errno(rc)) });
    }
    return .{ .base = rc, .file_bytes = file_bytes, .ino = st.ino, .dev = st.dev };
}

/// Creates the control segment under its temporary name (caller holds the lock), sized and
/// with the header written except the magic, which `publish` stores last.
pub fn create_unpublished(
    unique_id: []const u8,
    geometry: Geometry,
    identity: sys.ProcessId,
    diag: *Diag,
) SegError!Ctrl {
    assert(sys.unique_id_valid(unique_id));
    assert(geometry.ctrl_bytes > 0);
    var path_buffer: sys.PathBuffer = undefined;
    const path = sys.shm_path(&path_buffer, unique_id, ".ctrl.init");
    // A leftover from a creator killed before publishing: we hold the lock, nobody uses it.
    _ = linux.unlink(path);
    const open_rc = linux.open(path, .{ .ACCMODE = .RDWR, .CREAT = true, .EXCL = true, .CLOEXEC = true, .NOFOLLOW = true }, 0o600);
    if (sys.errno(open_rc) != .SUCCESS) {
        return diag.fail(error.System, "cannot create {s}: {s}", .{ path, @tagName(sys.errno(open_rc)) });
    }
    const fd: i32 = @intCast(open_rc);
    defer sys.close_fd(fd);
    _ = linux.fchmod(fd, 0o600);
    const file_bytes = ctrl_file_bytes(geometry.ctrl_bytes);
    if (sys.errno(linux.ftruncate(fd, @intCast(file_bytes))) != .SUCCESS) {
        _ = linux.unlink(path);
        return diag.fail(error.NoSpace, "cannot size the control segment {s} to {d} bytes", .{ path, file_bytes });
    }
    // Fresh tmpfs pages are zero: the control region starts zeroed, which is what the
    // caller's initialiser expects.
    var ctrl = map_fd(fd, file_bytes, diag, path) catch |err| {
        _ = linux.unlink(path);
        return err;
    };
    const h = ctrl.header();
    h.layout_version = constants.seg_layout_version;
    h.header_bytes = constants.seg_header_bytes;
    h.ctrl_layout_version = geometry.ctrl_layout_version;
    h.segment_count = geometry.segment_count();
    h.ctrl_bytes = geometry.ctrl_bytes;
    h.data_bytes = geometry.data_bytes;
    h.segment_bytes = geometry.segment_bytes;
    h.creator_pid = identity.pid;
    h.creator_uid = linux.geteuid();
    h.creator_start_time_ticks = identity.start_time_ticks;
    h.unique_id_len = @intCast(unique_id.len);
    @memcpy(h.unique_id[0..unique_id.len], unique_id);
    assert(h.magic == 0);
    return ctrl;
}

/// Stores the magic and links the temporary file to the final name. The caller holds the lock,
/// so the final name is free (a stale segment was unlinked before creation).
pub fn publish(unique_id: []const u8, ctrl: *Ctrl, diag: *Diag) SegError!void {
    assert(sys.unique_id_valid(unique_id));
    const h = ctrl.header();
    assert(h.magic == 0);
    // Release: every header and control-region store above becomes visible before the magic;
    // link() is a further barrier for other processes, which only map after it.
    @atomicStore(u64, &h.magic, constants.seg_magic, .release);
    var init_buffer: sys.PathBuffer = undefined;
    var final_buffer: sys.PathBuffer = undefined;
    const init_path = sys.shm_path(&init_buffer, unique_id, ".ctrl.init");
    const final_path = sys.shm_path(&final_buffer, unique_id, ".ctrl");
    const rc = linux.link(init_path, final_path);
    if (sys.errno(rc) != .SUCCESS) {
        return diag.fail(error.System, "cannot publish {s} as {s}: {s}", .{ init_path, final_path, @tagName(sys.errno(rc)) });
    }
    _ = linux.unlink(init_path);
}

/// Maps and validates the published control segment, or returns null when there is none.
pub fn open_published(unique_id: []const u8, diag: *Diag) SegError!?Ctrl {
    assert(sys.unique_id_valid(unique_id));
    var path_buffer: sys.PathBuffer = undefined;
    const path = sys.shm_path(&path_buffer, unique_id, ".ctrl");
    const open_rc = linux.open(path, .{ .ACCMODE = .RDWR, .CLOEXEC = true, .NOFOLLOW = true }, 0);
    switch (sys.errno(open_rc)) {
        .SUCCESS => {},
        .NOENT => return null,
        .ACCES, .PERM => return diag.fail(error.Permission, "cannot open the control segment {s}: permission denied (it belongs to another user; segments are owner-only, mode 0600)", .{path}),
        else => |err| return diag.fail(error.System, "cannot open the control segment {s}: {s}", .{ path, @tagName(err) }),
    }
    const fd: i32 = @intCast(open_rc);
    defer sys.close_fd(fd);
    var st: linux.Stat = undefined;
    if (sys.errno(linux.fstat(fd, &st)) != .SUCCESS) return diag.fail(error.System, "cannot stat {s}", .{path});
    const file_bytes: u64 = @intCast(st.size);
    if (file_bytes < constants.seg_header_bytes + constants.seg_page_bytes) {
        return diag.fail(error.Mismatch, "the control segment {s} is {d} bytes, too small to be a UCM segment (at least {d}); remove it if no UCM process uses it", .{ path, file_bytes, constants.seg_header_bytes + constants.seg_page_bytes });
    }
    var ctrl = try map_fd(fd, file_bytes, diag, path);
    errdefer ctrl.unmap();
    try validate_header(ctrl.header(), file_bytes, path, diag);
    return ctrl;
}

pub fn validate_header(h: *const Header, file_bytes: u64, path: []const u8, diag: *Diag) SegError!void {
    assert(file_bytes >= constants.seg_header_bytes);
    const magic = @atomicLoad(u64, &h.magic, .acquire);
    if (magic != constants.seg_magic) {
        return diag.fail(error.Mismatch, "the control segment {s} has magic 0x{x:0>16}, expected 0x{x:0>16} (\"UCM-SEG1\"): it is not a UCM segment or it is corrupt; remove it if no UCM process uses it", .{ path, magic, constants.seg_magic });
    }
    if (h.layout_version != constants.seg_layout_version) {
        return diag.fail(error.Mismatch, "the control segment {s} has layout version {d}, this library expects {d}: it was created by another UCM version; stop the processes using it (or remove it) before starting this version", .{ path, h.layout_version, constants.seg_layout_version });
    }
    const expected_file_bytes = if (h.ctrl_bytes > 0 and h.ctrl_bytes <= constants.seg_ctrl_bytes_max) ctrl_file_bytes(h.ctrl_bytes) else 0;
    const geometry_ok = h.header_bytes == constants.seg_header_bytes and
        expected_file_bytes == file_bytes and
        h.segment_bytes > 0 and h.data_bytes % h.segment_bytes == 0 and
        h.data_bytes / h.segment_bytes == h.segment_count and
        h.segment_count <= constants.seg_segments_max and
        h.unique_id_len <= constants.seg_unique_id_max_bytes;
    if (!geometry_ok) {
        return diag.fail(error.Mismatch, "the control segment {s} has a corrupt header (header_bytes {d}, ctrl_bytes {d}, file {d} bytes, data_bytes {d}, segment_bytes {d}, segment_count {d}); remove it if no UCM process uses it", .{ path, h.header_bytes, h.ctrl_bytes, file_bytes, h.data_bytes, h.segment_bytes, h.segment_count });
    }
}

/// Refuses to attach with another geometry than the creator's: slots would not line up.
pub fn check_geometry(h: *const Header, geometry: Geometry, unique_id: []const u8, diag: *Diag) SegError!void {
    assert(h.magic == constants.seg_magic);
    assert(geometry.segment_bytes > 0);
    if (h.ctrl_layout_version != geometry.ctrl_layout_version) {
        return diag.fail(error.Mismatch, "the buffer {s} has control layout version {d}, this process expects {d}: all ranks must run the same UCM version", .{ unique_id, h.ctrl_layout_version, geometry.ctrl_layout_version });
    }
    if (h.ctrl_bytes != geometry.ctrl_bytes or h.data_bytes != geometry.data_bytes or h.segment_bytes != geometry.segment_bytes) {
        return diag.fail(error.Mismatch, "the buffer {s} exists with ctrl_bytes={d} data_bytes={d} segment_bytes={d}, this process asked for ctrl_bytes={d} data_bytes={d} segment_bytes={d}: all ranks must open it with the same capacity and layout", .{ unique_id, h.ctrl_bytes, h.data_bytes, h.segment_bytes, geometry.ctrl_bytes, geometry.data_bytes, geometry.segment_bytes });
    }
}

pub fn entry_identity(entry: *const AttachEntry) ?sys.ProcessId {
    // Acquire: pairs with the release store of the pid in `register`.
    const pid = @atomicLoad(u32, &entry.pid, .acquire);
    if (pid == 0) return null;
    return .{ .pid = pid, .start_time_ticks = entry.start_time_ticks };
}

/// True when at least one live process holds the data segments (and so can hand them out).
pub fn any_server_alive(h: *const Header) bool {
    assert(h.magic == constants.seg_magic);
    var index: u32 = 0;
    while (index < constants.seg_attach_entries_max) : (index += 1) {
        const entry = &h.attach[index];
        const identity = entry_identity(entry) orelse continue;
        if (entry.flags & entry_flag_serves_data == 0) continue;
        if (sys.process_alive(identity)) return true;
    }
    assert(index == constants.seg_attach_entries_max);
    return false;
}

/// Claims a free (or dead process's) entry; the caller holds the lock.
pub fn register(h: *Header, identity: sys.ProcessId, flags: u32, diag: *Diag) SegError!u32 {
    assert(identity.pid != 0);
    assert(flags <= entry_flag_serves_data);
    var index: u32 = 0;
    while (index < constants.seg_attach_entries_max) : (index += 1) {
        const entry = &h.attach[index];
        if (entry_identity(entry)) |other| {
            if (sys.process_alive(other)) continue;
        }
        entry.flags = flags;
        entry.start_time_ticks = identity.start_time_ticks;
        // Release: flags and start time are visible to whoever reads this pid.
        @atomicStore(u32, &entry.pid, identity.pid, .release);
        return index;
    }
    return diag.fail(error.System, "the attach table of the buffer holds {d} live processes, the maximum; close unused ranks", .{constants.seg_attach_entries_max});
}

/// Frees our entry. Lock-free: only the owner writes a live entry.
pub fn deregister(h: *Header, index: u32, identity: sys.ProcessId) void {
    assert(index < constants.seg_attach_entries_max);
    const entry = &h.attach[index];
    assert(@atomicLoad(u32, &entry.pid, .monotonic) == identity.pid);
    // Release: our last writes to the control region happen before the entry reads as free.
    @atomicStore(u32, &entry.pid, 0, .release);
}

/// Unlinks the final name if it still refers to `ctrl` (the caller holds the lock).
pub fn unlink_if_same(unique_id: []const u8, ctrl: *const Ctrl) bool {
    assert(sys.unique_id_valid(unique_id));
    assert(ctrl.base != 0);
    var path_buffer: sys.PathBuffer = undefined;
    const path = sys.shm_path(&path_buffer, unique_id, ".ctrl");
    var st: linux.Stat = undefined;
    if (sys.errno(linux.fstatat(linux.AT.FDCWD, path, &st, linux.AT.SYMLINK_NOFOLLOW)) != .SUCCESS) return false;
    if (st.ino != ctrl.ino or st.dev != ctrl.dev) return false;
    return sys.errno(linux.unlink(path)) == .SUCCESS;
}

/// Removes every name of `unique_id` (tests, admin cleanup). Returns how many existed.
pub fn unlink_all(unique_id: []const u8) u32 {
    assert(sys.unique_id_valid(unique_id));
    const suffixes = [_][]const u8{ ".ctrl", ".ctrl.init", ".lock" };
    var removed: u32 = 0;
    for (suffixes) |suffix| {
        var path_buffer: sys.PathBuffer = undefined;
        const path = sys.shm_path(&path_buffer, unique_id, suffix);
        if (sys.errno(linux.unlink(path)) == .SUCCESS) removed += 1;
    }
    assert(removed <= suffixes.len);
    return removed;
}

test "create, publish, reopen and validate a control segment" {
    const unique_id = "zigtest-shm-a";
    _ = unlink_all(unique_id);
    defer _ = unlink_all(unique_id);
    var diag_buffer: [512]u8 = undefined;
    var diag = Diag.init(&diag_buffer);
    const geometry: Geometry = .{ .ctrl_bytes = 5000, .data_bytes = 8192, .segment_bytes = 4096, .ctrl_layout_version = 3 };
    var lock = try lock_acquire(unique_id, sys.monotonic_ns() + std.time.ns_per_s, &diag);
    var ctrl = try create_unpublished(unique_id, geometry, sys.self_identity(), &diag);
    try std.testing.expectEqual(@as(usize, 4096 + 8192), ctrl.file_bytes);
    try std.testing.expectEqual(@as(?Ctrl, null), try open_published(unique_id, &diag));
    @as(*u64, @ptrFromInt(ctrl.region_address())).* = 0xfeed;
    try publish(unique_id, &ctrl, &diag);
    lock.release();
    var again = (try open_published(unique_id, &diag)).?;
    defer again.unmap();
    try std.testing.expectEqual(@as(u64, 0xfeed), @as(*u64, @ptrFromInt(again.region_address())).*);
    try check_geometry(again.header(), geometry, unique_id, &diag);
    var other = geometry;
    other.ctrl_bytes = 4096;
    try std.testing.expectError(error.Mismatch, check_geometry(again.header(), other, unique_id, &diag));
    try std.testing.expect(std.mem.indexOf(u8, diag.message(), "ctrl_bytes=5000") != null);
    again.header().layout_version = 99;
    try std.testing.expectError(error.Mismatch, validate_header(again.header(), again.file_bytes, "x", &diag));
    try std.testing.expect(std.mem.indexOf(u8, diag.message(), "layout version 99, this library expects 1") != null);
    ctrl.unmap();
}

test "attach table registers, reclaims dead entries and reports servers" {
    var header = std.mem.zeroes(Header);
    header.magic = constants.seg_magic;
    var diag_buffer: [256]u8 = undefined;
    var diag = Diag.init(&diag_buffer);
    try std.testing.expect(!any_server_alive(&header));
    const me = sys.self_identity();
    const dead: sys.ProcessId = .{ .pid = me.pid, .start_time_ticks = me.start_time_ticks + 7 };
    try std.testing.expectEqual(@as(u32, 0), try register(&header, dead, entry_flag_serves_data, &diag));
    try std.testing.expect(!any_server_alive(&header));
    // The dead entry is reclaimed.
    try std.testing.expectEqual(@as(u32, 0), try register(&header, me, 0, &diag));
    try std.testing.expect(!any_server_alive(&header));
    try std.testing.expectEqual(@as(u32, 1), try register(&header, me, entry_flag_serves_data, &diag));
    try std.testing.expect(any_server_alive(&header));
    deregister(&header, 1, me);
    try std.testing.expect(!any_server_alive(&header));
}
