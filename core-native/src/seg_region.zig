//! A buffer's shared memory as one process sees it: the control segment (shm.zig) and the data
//! segments (memfd.zig), created or attached under the creation lock, with the data
//! descriptors served to later ranks (fdpass.zig).
//!
//! Open protocol (all under the lock of shm.zig):
//!   1. A published control segment with a live data holder: check the geometry, register in the
//!      attach table, drop the lock, fetch the data descriptors from a live holder, map them,
//!      start serving them too (so the buffer outlives its creator).
//!   2. A published segment whose holders are all dead (stale): unlink it, go to 3.
//!   3. None: check the space, create the control segment under its temporary name, create the
//!      data segments (sized, not yet faulted in: see populate.zig), start serving, and return "created" still holding the lock; the
//!      caller initialises its control region and calls `publish`, which links the segment to
//!      its final name and drops the lock.
//! A scheduler (role `scheduler`) attaching maps the control segment only. A scheduler that
//! creates still creates and serves the data (the workers need it) but does not map it.
const std = @import("std");
const linux = std.os.linux;
const constants = @import("constants.zig");
const sys = @import("seg_sys.zig");
const shm = @import("shm.zig");
const memfd = @import("memfd.zig");
const fdpass = @import("fdpass.zig");
const populate = @import("populate.zig");

const assert = std.debug.assert;
const SegError = sys.SegError;
const Diag = sys.Diag;

pub const Role = enum(u32) { worker = 0, scheduler = 1 };

/// What the C ABI reports about an open region (ucm_seg_info).
pub const Info = extern struct {
    header_address: u64,
    ctrl_address: u64,
    ctrl_bytes: u64,
    data_address: u64,
    data_bytes: u64,
    segment_bytes: u64,
    segment_count: u32,
    role: u32,
    created: u32,
    published: u32,
    replaced_stale: u32,
    stale_creator_pid: u32,
    huge_pages: u32,
    hugetlb_fallback: u32,
    hugetlb_errno: u32,
    creator_pid: u32,
    entry_index: u32,
    serves_data: u32,
    served_count: u32,
    refused_count: u32,
};

comptime {
    assert(@sizeOf(Info) == 6 * 8 + 14 * 4);
    assert(@offsetOf(Info, "segment_count") == 48);
}

pub const Region = struct {
    unique_id_buffer: [constants.seg_unique_id_max_bytes]u8 = undefined,
    unique_id_len: usize = 0,
    role: Role = .worker,
    identity: sys.ProcessId = undefined,
    geometry: shm.Geometry = undefined,
    ctrl: shm.Ctrl = .{ .base = 0, .file_bytes = 0, .ino = 0, .dev = 0 },
    entry_index: u32 = constants.seg_attach_entries_max,
    data: memfd.DataSet = .{},
    mapping: memfd.Mapping = .{ .base = 0, .bytes = 0, .reservation = 0, .reservation_bytes = 0 },
    server: fdpass.Server = .{},
    /// Background population of `mapping` (started by `start_population`, stopped by `close`).
    populater: populate.Populater = .{},
    lock: shm.Lock = .{ .fd = -1 },
    created: bool = false,
    published: bool = false,
    replaced_stale: bool = false,
    stale_creator_pid: u32 = 0,

    pub fn unique_id(self: *const Region) []const u8 {
        assert(self.unique_id_len > 0);
        assert(self.unique_id_len <= self.unique_id_buffer.len);
        return self.unique_id_buffer[0..self.unique_id_len];
    }

    pub fn info(self: *const Region) Info {
        assert(self.ctrl.base != 0);
        const h = self.ctrl.header();
        return .{
            .header_address = self.ctrl.base,
            .ctrl_address = self.ctrl.region_address(),
            .ctrl_bytes = self.geometry.ctrl_bytes,
            .data_address = self.mapping.base,
            .data_bytes = self.geometry.data_bytes,
            .segment_bytes = self.geometry.segment_bytes,
            .segment_count = self.geometry.segment_count(),
            .role = @intFromEnum(self.role),
            .created = @intFromBool(self.created),
            .published = @intFromBool(self.published),
            .replaced_stale = @intFromBool(self.replaced_stale),
            .stale_creator_pid = self.stale_creator_pid,
            .huge_pages = h.huge_pages,
            .hugetlb_fallback = h.hugetlb_fallback & 0xffff,
            .hugetlb_errno = h.hugetlb_fallback >> 16,
            .creator_pid = h.creator_pid,
            .entry_index = self.entry_index,
            .serves_data = @intFromBool(self.server.started()),
            .served_count = self.server.served_count.load(.monotonic),
            .refused_count = self.server.refused_count.load(.monotonic),
        };
    }
};

pub fn check_arguments(unique_id: []const u8, geometry: shm.Geometry, role: u32, policy: u32, diag: *Diag) SegError!void {
    assert(diag.len == 0);
    if (!sys.unique_id_valid(unique_id)) {
        return diag.fail(error.InvalidArgument, "unique_id={s} is not valid: use 1 to {d} characters among A-Z a-z 0-9 _ - . not starting with '.' or '-'", .{ unique_id[0..@min(unique_id.len, 200)], constants.seg_unique_id_max_bytes });
    }
    if (geometry.ctrl_bytes == 0 or geometry.ctrl_bytes > constants.seg_ctrl_bytes_max) {
        return diag.fail(error.InvalidArgument, "ctrl_bytes={d} is not valid: expected 1 to {d}", .{ geometry.ctrl_bytes, constants.seg_ctrl_bytes_max });
    }
    if (geometry.segment_bytes == 0 or geometry.segment_bytes % constants.seg_page_bytes != 0 or geometry.segment_bytes > constants.seg_data_bytes_max) {
        return diag.fail(error.InvalidArgument, "segment_bytes={d} is not valid: expected a positive multiple of the {d}-byte page", .{ geometry.segment_bytes, constants.seg_page_bytes });
    }
    if (geometry.data_bytes == 0 or geometry.data_bytes % geometry.segment_bytes != 0 or geometry.data_bytes > constants.seg_data_bytes_max) {
        return diag.fail(error.InvalidArgument, "data_bytes={d} is not valid: expected a positive multiple of segment_bytes={d}, at most {d}", .{ geometry.data_bytes, geometry.segment_bytes, constants.seg_data_bytes_max });
    }
    if (geometry.data_bytes / geometry.segment_bytes > constants.seg_segments_max) {
        return diag.fail(error.InvalidArgument, "data_bytes={d} makes {d} segments of segment_bytes={d}, more than the {d} allowed: use larger segments", .{ geometry.data_bytes, geometry.data_bytes / geometry.segment_bytes, geometry.segment_bytes, constants.seg_segments_max });
    }
    if (std.meta.intToEnum(Role, role) catch null == null) {
        return diag.fail(error.InvalidArgument, "role={d} is not valid: expected 0 (worker) or 1 (scheduler)", .{role});
    }
    if (std.meta.intToEnum(memfd.HugetlbPolicy, policy) catch null == null) {
        return diag.fail(error.InvalidArgument, "hugetlb={d} is not valid: expected 0 (auto), 1 (off) or 2 (try)", .{policy});
    }
}

/// Opens (creates or attaches) the region. Returns true when this process created it: the
/// caller then initialises the control region and calls `publish`.
pub fn open(
    self: *Region,
    unique_id: []const u8,
    geometry: shm.Geometry,
    role: Role,
    policy: memfd.HugetlbPolicy,
    timeout_ns: u64,
    diag: *Diag,
) SegError!bool {
    assert(sys.unique_id_valid(unique_id));
    assert(self.ctrl.base == 0);
    self.* = .{};
    @memcpy(self.unique_id_buffer[0..unique_id.len], unique_id);
    self.unique_id_len = unique_id.len;
    self.role = role;
    self.identity = sys.self_identity();
    self.geometry = geometry;
    const deadline_ns = sys.monotonic_ns() +| timeout_ns;
    self.lock = try shm.lock_acquire(unique_id, deadline_ns, diag);
    errdefer if (self.lock.fd >= 0) self.lock.release();
    if (try shm.open_published(unique_id, diag)) |existing| {
        self.ctrl = existing;
        if (shm.any_server_alive(self.ctrl.header())) {
            errdefer self.ctrl.unmap();
            try attach(self, deadline_ns, diag);
            return false;
        }
        // Stale: the data died with its last holder, the control plane alone is useless.
        self.replaced_stale = true;
        self.stale_creator_pid = self.ctrl.header().creator_pid;
        _ = shm.unlink_if_same(unique_id, &self.ctrl);
        self.ctrl.unmap();
    }
    try create(self, policy, diag);
    return true;
}

fn attach(self: *Region, deadline_ns: u64, diag: *Diag) SegError!void {
    assert(self.lock.fd >= 0);
    assert(self.ctrl.base != 0);
    const h = self.ctrl.header();
    try shm.check_geometry(h, self.geometry, self.unique_id(), diag);
    const flags: u32 = if (self.role == .worker) shm.entry_flag_serves_data else 0;
    self.entry_index = try shm.register(h, self.identity, flags, diag);
    self.lock.release();
    errdefer shm.deregister(h, self.entry_index, self.identity);
    if (self.role == .scheduler) return;
    const count = self.geometry.segment_count();
    try fetch_data(self, count, deadline_ns, diag);
    errdefer self.data.close_all();
    try memfd.map(&self.data, &self.mapping, diag);
    errdefer self.mapping.unmap();
    self.populater.init(self.mapping.base, self.mapping.bytes);
    try self.server.start(self.unique_id(), self.identity.pid, self.entry_index, self.data.fds[0..count], diag);
}

/// Asks each live holder in turn for the descriptors until one hands them out.
fn fetch_data(self: *Region, count: u32, deadline_ns: u64, diag: *Diag) SegError!void {
    assert(count > 0);
    assert(self.data.count == 0);
    const h = self.ctrl.header();
    var attempts: u32 = 0;
    var index: u32 = 0;
    while (index < constants.seg_attach_entries_max) : (index += 1) {
        if (index == self.entry_index) continue;
        const entry = &h.attach[index];
        const holder = shm.entry_identity(entry) orelse continue;
        if (entry.flags & shm.entry_flag_serves_data == 0) continue;
        if (!sys.process_alive(holder)) continue;
        if (sys.monotonic_ns() >= deadline_ns) break;
        attempts += 1;
        fdpass.fetch(self.unique_id(), holder.pid, index, self.data.fds[0..count], diag) catch |err| {
            // Every holder runs as the same user: one refusal means all would refuse.
            if (err == error.Permission) return err;
            continue;
        };
        self.data.count = count;
        self.data.segment_bytes = self.geometry.segment_bytes;
        try check_fds(self, diag);
        return;
    }
    if (attempts == 0) {
        return diag.fail(error.System, "no live process holds the data segments of buffer {s}", .{self.unique_id()});
    }
    const last = diag.message();
    var copy: [256]u8 = undefined;
    const shown = last[0..@min(last.len, copy.len)];
    @memcpy(copy[0..shown.len], shown);
    return diag.fail(error.System, "could not get the data segments of buffer {s} from any of {d} live holders (last: {s})", .{ self.unique_id(), attempts, copy[0..shown.len] });
}

fn check_fds(self: *Region, diag: *Diag) SegError!void {
    assert(self.data.count > 0);
    assert(self.data.segment_bytes == self.geometry.segment_bytes);
    for (self.data.fds[0..self.data.count], 0..) |fd, index| {
        var st: linux.Stat = undefined;
        const ok = sys.errno(linux.fstat(fd, &st)) == .SUCCESS and st.size == self.geometry.segment_bytes;
        if (!ok) {
            self.data.close_all();
            return diag.fail(error.Mismatch, "data segment {d} received from a peer is {d} bytes, expected segment_bytes={d}", .{ index, st.size, self.geometry.segment_bytes });
        }
    }
}

fn create(self: *Region, policy: memfd.HugetlbPolicy, diag: *Diag) SegError!void {
    assert(self.lock.fd >= 0);
    assert(self.ctrl.base == 0);
    try memfd.check_space(shm.ctrl_file_bytes(self.geometry.ctrl_bytes), self.geometry.data_bytes, diag);
    self.ctrl = try shm.create_unpublished(self.unique_id(), self.geometry, self.identity, diag);
    errdefer {
        self.ctrl.unmap();
        remove_unpublished(self.unique_id());
    }
    const h = self.ctrl.header();
    // The creator always holds and serves the data, a scheduler included.
    self.entry_index = try shm.register(h, self.identity, shm.entry_flag_serves_data, diag);
    const count = self.geometry.segment_count();
    const created = try memfd.create(&self.data, &self.mapping, count, self.geometry.segment_bytes, policy, diag);
    errdefer self.data.close_all();
    h.huge_pages = @intFromEnum(created.huge_pages);
    h.hugetlb_fallback = @intFromEnum(created.fallback) | (created.fallback_errno << 16);
    if (self.role == .scheduler) self.mapping.unmap();
    errdefer if (self.mapping.base != 0) self.mapping.unmap();
    if (self.mapping.base != 0) self.populater.init(self.mapping.base, self.mapping.bytes);
    try self.server.start(self.unique_id(), self.identity.pid, self.entry_index, self.data.fds[0..count], diag);
    self.created = true;
}

fn remove_unpublished(unique_id: []const u8) void {
    var path_buffer: sys.PathBuffer = undefined;
    _ = linux.unlink(sys.shm_path(&path_buffer, unique_id, ".ctrl.init"));
}

/// Makes a created region visible to the other ranks and drops the creation lock.
pub fn publish(self: *Region, diag: *Diag) SegError!void {
    assert(self.created and !self.published);
    assert(self.lock.fd >= 0);
    try shm.publish(self.unique_id(), &self.ctrl, diag);
    self.published = true;
    self.lock.release();
}

/// Starts `thread_count` background threads faulting this process's data mapping in (0: lazy,
/// pages fault in on first touch). Returns how many started; none without a data mapping.
pub fn start_population(self: *Region, thread_count: u32) u32 {
    assert(thread_count <= constants.populate_threads_max);
    if (self.mapping.base == 0 or self.populater.thread_count > 0) return 0;
    return self.populater.start(thread_count);
}

pub const Residency = extern struct {
    /// Bytes of the data segments backed by memory, node-wide (the memfds' allocated blocks).
    resident_bytes: u64,
    data_bytes: u64,
    /// This process's populater.
    populate: populate.Populater.Progress,
};

pub fn residency(self: *const Region) Residency {
    var resident: u64 = 0;
    for (self.data.fds[0..self.data.count]) |fd| {
        var st: linux.Stat = undefined;
        if (sys.errno(linux.fstat(fd, &st)) != .SUCCESS) continue;
        resident += @as(u64, @intCast(@max(st.blocks, 0))) * 512;
    }
    const progress = if (self.mapping.base != 0) self.populater.progress() else std.mem.zeroes(populate.Populater.Progress);
    return .{ .resident_bytes = @min(resident, self.geometry.data_bytes), .data_bytes = self.geometry.data_bytes, .populate = progress };
}

/// Releases everything; the serve loop must have returned. The last data holder to leave
/// unlinks the control segment: the data dies with the last descriptor anyway.
pub fn close(self: *Region) void {
    assert(self.ctrl.base != 0);
    assert(self.unique_id_len > 0);
    if (self.server.started()) self.server.deinit();
    // The populater writes into the mapping: it stops before the mapping goes.
    self.populater.stop_and_join();
    if (self.mapping.base != 0) self.mapping.unmap();
    self.data.close_all();
    const h = self.ctrl.header();
    if (self.entry_index < constants.seg_attach_entries_max) shm.deregister(h, self.entry_index, self.identity);
    if (self.created and !self.published) {
        // Created but never published (the initialiser failed): nobody else saw it.
        remove_unpublished(self.unique_id());
        self.lock.release();
    } else if (shm.lock_try(self.unique_id())) |held| {
        var lock = held;
        if (!shm.any_server_alive(h) and shm.unlink_if_same(self.unique_id(), &self.ctrl)) {
            // Leave /dev/shm clean. Waiters on the old lock inode notice the name changed
            // (lock_acquire compares inodes) and retry on a fresh one.
            var path_buffer: sys.PathBuffer = undefined;
            _ = linux.unlink(sys.shm_path(&path_buffer, self.unique_id(), ".lock"));
        }
        lock.release();
    }
    self.ctrl.unmap();
    assert(self.lock.fd == -1);
}

fn test_geometry() shm.Geometry {
    return .{ .ctrl_bytes = 4096, .data_bytes = 2 * 65536, .segment_bytes = 65536, .ctrl_layout_version = 1 };
}

test "create, publish, attach in-process, share bytes, close unlinks" {
    const unique_id = "zigtest-region-a";
    _ = shm.unlink_all(unique_id);
    defer _ = shm.unlink_all(unique_id);
    var diag_buffer: [512]u8 = undefined;
    var diag = Diag.init(&diag_buffer);
    var first: Region = .{};
    try std.testing.expect(try open(&first, unique_id, test_geometry(), .worker, .auto, std.time.ns_per_s, &diag));
    @as(*u32, @ptrFromInt(first.info().ctrl_address)).* = 77;
    @as(*u8, @ptrFromInt(first.info().data_address + 65536 + 3)).* = 0x5a;
    try publish(&first, &diag);
    try std.testing.expectEqual(@as(u32, @intFromEnum(memfd.Fallback.size_not_aligned)), first.info().hugetlb_fallback);
    const thread = try std.Thread.spawn(.{}, fdpass.Server.serve, .{&first.server});
    var second: Region = .{};
    try std.testing.expect(!try open(&second, unique_id, test_geometry(), .worker, .auto, std.time.ns_per_s, &diag));
    try std.testing.expectEqual(@as(u32, 77), @as(*u32, @ptrFromInt(second.info().ctrl_address)).*);
    try std.testing.expectEqual(@as(u8, 0x5a), @as(*u8, @ptrFromInt(second.info().data_address + 65536 + 3)).*);
    try std.testing.expect(second.info().data_address != first.info().data_address);
    var scheduler: Region = .{};
    try std.testing.expect(!try open(&scheduler, unique_id, test_geometry(), .scheduler, .auto, std.time.ns_per_s, &diag));
    try std.testing.expectEqual(@as(u64, 0), scheduler.info().data_address);
    var wrong = test_geometry();
    wrong.data_bytes = 65536;
    var third: Region = .{};
    try std.testing.expectError(error.Mismatch, open(&third, unique_id, wrong, .worker, .auto, std.time.ns_per_s, &diag));
    first.server.request_stop();
    thread.join();
    close(&scheduler);
    close(&first);
    close(&second);
    var path_buffer: sys.PathBuffer = undefined;
    var st: linux.Stat = undefined;
    const path = sys.shm_path(&path_buffer, unique_id, ".ctrl");
    try std.testing.expectEqual(linux.E.NOENT, sys.errno(linux.fstatat(linux.AT.FDCWD, path, &st, 0)));
}

test "arguments are checked with messages naming them" {
    var diag_buffer: [512]u8 = undefined;
    var diag = Diag.init(&diag_buffer);
    var geometry = test_geometry();
    geometry.segment_bytes = 1000;
    try std.testing.expectError(error.InvalidArgument, check_arguments("ok", geometry, 0, 0, &diag));
    try std.testing.expect(std.mem.startsWith(u8, diag.message(), "segment_bytes=1000 is not valid"));
    diag.len = 0;
    try std.testing.expectError(error.InvalidArgument, check_arguments("ok", test_geometry(), 9, 0, &diag));
    try std.testing.expect(std.mem.startsWith(u8, diag.message(), "role=9 is not valid"));
}
