//! The data plane: shard slots live in anonymous memfd segments, shared with the other ranks by
//! passing the descriptors (fdpass.zig), never by name.
//!
//! Huge pages: MFD_HUGETLB is tried first when the kernel has enough free hugetlb pages (or when
//! the caller forces the attempt); hugetlb reserves its pages at mmap time, so a shortage shows
//! up as an mmap error, and the code falls back to a normal memfd with madvise(MADV_HUGEPAGE)
//! (transparent huge pages, effective only if shmem THP is enabled). The mode in use and the
//! reason for the fallback are reported to the caller.
//!
//! Segments are created sized (ftruncate) but not faulted in: pre-faulting cost ~1.9 s per GiB at
//! open. populate.zig faults them in behind open on background threads; a page nobody populated
//! yet is allocated on its first touch. Sizes are checked against /dev/shm before anything is
//! created, and the native queue populates a slot's pages (an errno, not a SIGBUS, on a
//! shortage) before it writes them.
const std = @import("std");
const linux = std.os.linux;
const constants = @import("constants.zig");
const sys = @import("seg_sys.zig");

const assert = std.debug.assert;
const SegError = sys.SegError;
const Diag = sys.Diag;

pub const HugePages = enum(u32) { none = 0, thp = 1, hugetlb = 2 };

pub const HugetlbPolicy = enum(u32) {
    /// Try hugetlb when /proc/meminfo shows enough free huge pages.
    auto = 0,
    /// Never try hugetlb.
    off = 1,
    /// Try hugetlb whatever /proc/meminfo says (tests the fallback on a machine without pages).
    force_try = 2,
};

/// Why hugetlb is not in use (`used` when it is).
pub const Fallback = enum(u32) {
    used = 0,
    disabled = 1,
    no_free_pages = 2,
    size_not_aligned = 3,
    memfd_failed = 4,
    ftruncate_failed = 5,
    mmap_failed = 6,
};

pub const DataSet = struct {
    fds: [constants.seg_segments_max]i32 = [_]i32{-1} ** constants.seg_segments_max,
    count: u32 = 0,
    segment_bytes: u64 = 0,

    pub fn close_all(self: *DataSet) void {
        assert(self.count <= constants.seg_segments_max);
        for (self.fds[0..self.count]) |*fd| {
            if (fd.* >= 0) sys.close_fd(fd.*);
            fd.* = -1;
        }
        self.count = 0;
        assert(self.count == 0);
    }
};

/// A contiguous virtual range holding every segment back to back: segment i starts at
/// `base + i * segment_bytes`.
pub const Mapping = struct {
    base: usize,
    bytes: usize,
    reservation: usize,
    reservation_bytes: usize,

    pub fn unmap(self: *Mapping) void {
        assert(self.reservation != 0);
        assert(self.base >= self.reservation);
        _ = linux.munmap(@ptrFromInt(self.reservation), self.reservation_bytes);
        self.* = .{ .base = 0, .bytes = 0, .reservation = 0, .reservation_bytes = 0 };
    }
};

pub const Created = struct {
    huge_pages: HugePages,
    fallback: Fallback,
    /// The errno of the failed hugetlb step (0 if none), for the report.
    fallback_errno: u32,
};

pub const MemInfo = struct {
    huge_page_bytes: u64,
    huge_pages_free: u64,
};

/// Hugepagesize and HugePages_Free from /proc/meminfo (zeros when unreadable).
pub fn read_meminfo() MemInfo {
    var info: MemInfo = .{ .huge_page_bytes = 0, .huge_pages_free = 0 };
    const open_rc = linux.open("/proc/meminfo", .{ .ACCMODE = .RDONLY, .CLOEXEC = true }, 0);
    if (sys.errno(open_rc) != .SUCCESS) return info;
    const fd: i32 = @intCast(open_rc);
    defer sys.close_fd(fd);
    var buffer: [8192]u8 = undefined;
    const read_rc = linux.read(fd, &buffer, buffer.len);
    if (sys.errno(read_rc) != .SUCCESS) return info;
    var lines = std.mem.tokenizeScalar(u8, buffer[0..read_rc], '\n');
    var line_count: u32 = 0;
    while (lines.next()) |line| : (line_count += 1) {
        assert(line_count < buffer.len);
        if (field_value(line, "HugePages_Free:")) |value| info.huge_pages_free = value;
        if (field_value(line, "Hugepagesize:")) |value| info.huge_page_bytes = value * 1024;
    }
    return info;
}

fn field_value(line: []const u8, name: []const u8) ?u64 {
    assert(name.len > 0);
    if (!std.mem.startsWith(u8, line, name)) return null;
    var words = std.mem.tokenizeScalar(u8, line[name.len..], ' ');
    const word = words.next() orelse return null;
    return std.fmt.parseInt(u64, word, 10) catch null;
}

/// True when the kernel may back a MADV_HUGEPAGE shmem mapping with huge pages.
fn shmem_thp_enabled() bool {
    const open_rc = linux.open("/sys/kernel/mm/transparent_hugepage/shmem_enabled", .{ .ACCMODE = .RDONLY, .CLOEXEC = true }, 0);
    if (sys.errno(open_rc) != .SUCCESS) return false;
    const fd: i32 = @intCast(open_rc);
    defer sys.close_fd(fd);
    var buffer: [256]u8 = undefined;
    const read_rc = linux.read(fd, &buffer, buffer.len);
    if (sys.errno(read_rc) != .SUCCESS) return false;
    const text = buffer[0..read_rc];
    // The selected mode is bracketed: "always within_size advise [never] deny force".
    const disabled = std.mem.indexOf(u8, text, "[never]") != null or std.mem.indexOf(u8, text, "[deny]") != null;
    assert(text.len <= buffer.len);
    return !disabled;
}

/// Refuses, before allocating anything, a request that /dev/shm (or the free hugetlb pages)
/// cannot hold.
pub fn check_space(ctrl_file_bytes: u64, data_bytes: u64, diag: *Diag) SegError!void {
    assert(ctrl_file_bytes > 0);
    assert(data_bytes <= constants.seg_data_bytes_max);
    const available_bytes = sys.available_bytes(constants.seg_shm_dir) orelse
        return diag.fail(error.System, "cannot statfs {s}", .{constants.seg_shm_dir});
    const meminfo = read_meminfo();
    const huge_free_bytes = meminfo.huge_pages_free *| meminfo.huge_page_bytes;
    const data_fits_huge = data_bytes > 0 and huge_free_bytes >= data_bytes;
    const needed_bytes = ctrl_file_bytes + (if (data_fits_huge) 0 else data_bytes);
    if (needed_bytes > available_bytes) {
        return diag.fail(error.NoSpace, "the buffer needs {d} bytes of shared memory ({d} control + {d} data) but {s} has {d} bytes available and the free huge pages hold {d} bytes; lower the buffer capacity (or enlarge {s})", .{ needed_bytes, ctrl_file_bytes, data_bytes, constants.seg_shm_dir, available_bytes, huge_free_bytes, constants.seg_shm_dir });
    }
}

/// Creates `count` segments of `segment_bytes` and maps them into `mapping`; no page is
/// allocated yet (populate.zig faults them in behind open).
pub fn create(
    set: *DataSet,
    mapping: *Mapping,
    count: u32,
    segment_bytes: u64,
    policy: HugetlbPolicy,
    diag: *Diag,
) SegError!Created {
    assert(count > 0 and count <= constants.seg_segments_max);
    assert(segment_bytes % constants.seg_page_bytes == 0);
    assert(set.count == 0);
    const meminfo = read_meminfo();
    var created: Created = .{ .huge_pages = .none, .fallback = .disabled, .fallback_errno = 0 };
    if (policy != .off) {
        const total_bytes = segment_bytes * count;
        if (meminfo.huge_page_bytes == 0 or segment_bytes % meminfo.huge_page_bytes != 0) {
            created.fallback = .size_not_aligned;
        } else if (policy == .auto and meminfo.huge_pages_free * meminfo.huge_page_bytes < total_bytes) {
            created.fallback = .no_free_pages;
        } else if (try_create(set, mapping, count, segment_bytes, true, &created, diag)) {
            created.huge_pages = .hugetlb;
            created.fallback = .used;
            return created;
        }
    }
    assert(set.count == 0);
    if (!try_create(set, mapping, count, segment_bytes, false, &created, diag)) {
        return error.NoSpace;
    }
    const advise_rc = linux.madvise(@ptrFromInt(mapping.base), mapping.bytes, linux.MADV.HUGEPAGE);
    created.huge_pages = if (sys.errno(advise_rc) == .SUCCESS and shmem_thp_enabled()) .thp else .none;
    return created;
}

/// One attempt with or without MFD_HUGETLB. On failure everything is released; for hugetlb the
/// reason lands in `created`, for normal pages in `diag`.
fn try_create(
    set: *DataSet,
    mapping: *Mapping,
    count: u32,
    segment_bytes: u64,
    hugetlb: bool,
    created: *Created,
    diag: *Diag,
) bool {
    assert(set.count == 0);
    assert(count <= constants.seg_segments_max);
    set.segment_bytes = segment_bytes;
    const flags: u32 = linux.MFD.CLOEXEC | (if (hugetlb) @as(u32, linux.MFD.HUGETLB) else 0);
    var index: u32 = 0;
    while (index < count) : (index += 1) {
        const rc = linux.memfd_create("ucm-data", flags);
        if (sys.errno(rc) != .SUCCESS) {
            note_failure(hugetlb, created, .memfd_failed, sys.errno(rc), diag, "memfd_create", segment_bytes);
            set.close_all();
            return false;
        }
        set.fds[index] = @intCast(rc);
        set.count = index + 1;
        const truncate_rc = linux.ftruncate(set.fds[index], @intCast(segment_bytes));
        if (sys.errno(truncate_rc) != .SUCCESS) {
            note_failure(hugetlb, created, .ftruncate_failed, sys.errno(truncate_rc), diag, "ftruncate", segment_bytes);
            set.close_all();
            return false;
        }
    }
    const map_err = map_raw(set, mapping);
    if (map_err != .SUCCESS) {
        note_failure(hugetlb, created, .mmap_failed, map_err, diag, "mmap", segment_bytes);
        set.close_all();
        return false;
    }
    // MADV_HUGEPAGE must precede the first touch to matter; hugetlb mappings are huge already.
    if (!hugetlb) _ = linux.madvise(@ptrFromInt(mapping.base), mapping.bytes, linux.MADV.HUGEPAGE);
    assert(set.count == count);
    return true;
}

fn note_failure(hugetlb: bool, created: *Created, reason: Fallback, err: linux.E, diag: *Diag, step: []const u8, segment_bytes: u64) void {
    assert(reason != .used);
    assert(err != .SUCCESS);
    if (hugetlb) {
        created.fallback = reason;
        created.fallback_errno = @intFromEnum(err);
    } else {
        diag.record("cannot allocate a {d}-byte shared-memory data segment: {s} failed with {s}; lower the buffer capacity", .{ segment_bytes, step, @tagName(err) });
    }
}

/// Maps every descriptor of `set` back to back into a fresh, huge-page-aligned range.
pub fn map(set: *const DataSet, mapping: *Mapping, diag: *Diag) SegError!void {
    assert(set.count > 0);
    assert(set.segment_bytes % constants.seg_page_bytes == 0);
    const err = map_raw(set, mapping);
    if (err != .SUCCESS) {
        return diag.fail(error.NoSpace, "cannot map {d} data segments of {d} bytes: {s}", .{ set.count, set.segment_bytes, @tagName(err) });
    }
}

fn map_raw(set: *const DataSet, mapping: *Mapping) linux.E {
    assert(set.count > 0);
    assert(set.segment_bytes % constants.seg_page_bytes == 0);
    const bytes: usize = @intCast(set.segment_bytes * set.count);
    const reservation_bytes = bytes + constants.seg_huge_page_bytes;
    // A PROT_NONE reservation keeps the range ours while segments are placed with MAP_FIXED.
    const reserve_rc = linux.mmap(null, reservation_bytes, linux.PROT.NONE, .{ .TYPE = .PRIVATE, .ANONYMOUS = true, .NORESERVE = true }, -1, 0);
    if (sys.errno(reserve_rc) != .SUCCESS) return sys.errno(reserve_rc);
    const base = std.mem.alignForward(usize, reserve_rc, constants.seg_huge_page_bytes);
    var index: u32 = 0;
    while (index < set.count) : (index += 1) {
        const address = base + index * @as(usize, @intCast(set.segment_bytes));
        const rc = linux.mmap(@ptrFromInt(address), @intCast(set.segment_bytes), linux.PROT.READ | linux.PROT.WRITE, .{ .TYPE = .SHARED, .FIXED = true }, set.fds[index], 0);
        if (sys.errno(rc) != .SUCCESS) {
            _ = linux.munmap(@ptrFromInt(reserve_rc), reservation_bytes);
            return sys.errno(rc);
        }
        assert(rc == address);
    }
    mapping.* = .{ .base = base, .bytes = bytes, .reservation = reserve_rc, .reservation_bytes = reservation_bytes };
    return .SUCCESS;
}

test "normal memfd segments are created, mapped contiguously and shared, nothing allocated" {
    var diag_buffer: [512]u8 = undefined;
    var diag = Diag.init(&diag_buffer);
    var set: DataSet = .{};
    var mapping: Mapping = undefined;
    const created = try create(&set, &mapping, 3, 64 * 1024, .off, &diag);
    defer set.close_all();
    defer mapping.unmap();
    try std.testing.expectEqual(Fallback.disabled, created.fallback);
    try std.testing.expectEqual(@as(u32, 3), set.count);
    try std.testing.expectEqual(@as(usize, 0), mapping.base % constants.seg_huge_page_bytes);
    // Creation allocates no page: open time does not grow with capacity (populate.zig).
    var st: linux.Stat = undefined;
    try std.testing.expectEqual(linux.E.SUCCESS, sys.errno(linux.fstat(set.fds[2], &st)));
    try std.testing.expectEqual(@as(i64, 0), st.blocks);
    const bytes: [*]u8 = @ptrFromInt(mapping.base);
    bytes[2 * 64 * 1024 + 5] = 0xab;
    // A second mapping of the same descriptors sees the byte: the pages are shared.
    var second: Mapping = undefined;
    try map(&set, &second, &diag);
    defer second.unmap();
    try std.testing.expectEqual(@as(u8, 0xab), @as([*]u8, @ptrFromInt(second.base))[2 * 64 * 1024 + 5]);
}

test "forced hugetlb attempt falls back when the kernel has no free huge pages" {
    const meminfo = read_meminfo();
    if (meminfo.huge_pages_free * meminfo.huge_page_bytes >= 4 * 1024 * 1024) return error.SkipZigTest;
    var diag_buffer: [512]u8 = undefined;
    var diag = Diag.init(&diag_buffer);
    var set: DataSet = .{};
    var mapping: Mapping = undefined;
    const created = try create(&set, &mapping, 2, 2 * 1024 * 1024, .force_try, &diag);
    defer set.close_all();
    defer mapping.unmap();
    try std.testing.expect(created.huge_pages != .hugetlb);
    try std.testing.expect(created.fallback == .mmap_failed or created.fallback == .memfd_failed or created.fallback == .ftruncate_failed);
    var auto_set: DataSet = .{};
    var auto_mapping: Mapping = undefined;
    const auto = try create(&auto_set, &auto_mapping, 1, 2 * 1024 * 1024, .auto, &diag);
    defer auto_set.close_all();
    defer auto_mapping.unmap();
    try std.testing.expectEqual(Fallback.no_free_pages, auto.fallback);
}

test "check_space refuses more than /dev/shm holds, naming both numbers" {
    var diag_buffer: [512]u8 = undefined;
    var diag = Diag.init(&diag_buffer);
    try check_space(8192, 1 << 20, &diag);
    try std.testing.expectError(error.NoSpace, check_space(8192, constants.seg_data_bytes_max, &diag));
    try std.testing.expect(std.mem.indexOf(u8, diag.message(), "lower the buffer capacity") != null);
}
