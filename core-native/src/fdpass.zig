//! Hands the data segment descriptors to other ranks over a Unix domain socket (SCM_RIGHTS).
//!
//! Every process that holds the descriptors (the creator and each attached worker rank, so the
//! buffer outlives its creator) listens on an abstract-namespace SOCK_SEQPACKET socket named
//! "\0ucm-<unique_id>-<pid>-<attach entry index>". Abstract sockets have no file permissions,
//! so the server checks the peer's SO_PEERCRED uid against its own before sending anything and
//! answers a refusal otherwise. SEQPACKET keeps message boundaries: each message is one
//! `Reply` plus up to `seg_fd_chunk_count` descriptors.
//!
//! The serve loop blocks in poll() on the listening socket and an eventfd; `request_stop`
//! writes the eventfd, so the loop returns at once and close never hangs. The loop is meant to
//! run on a thread the host owns (the Python binding runs it on a daemon thread), which keeps
//! the library free of its own threads.
const std = @import("std");
const linux = std.os.linux;
const constants = @import("constants.zig");
const sys = @import("seg_sys.zig");

const assert = std.debug.assert;
const SegError = sys.SegError;
const Diag = sys.Diag;

const scm_rights: i32 = 1;
const msg_ctrunc: u32 = 8;
const msg_cmsg_cloexec: u32 = 0x40000000;
const reply_magic: u32 = 0x55434d46; // "UCMF"

pub const Status = enum(u32) { ok = 0, refused_uid = 1 };

pub const Reply = extern struct {
    magic: u32,
    status: u32,
    segment_count: u32,
    first_index: u32,
    chunk_count: u32,
    peer_uid: u32,
    expected_uid: u32,
    reserved: u32,
};

const Cmsghdr = extern struct {
    len: usize,
    level: i32,
    type: i32,
};

const Ucred = extern struct {
    pid: i32,
    uid: u32,
    gid: u32,
};

const Timeval = extern struct {
    sec: i64,
    usec: i64,
};

const control_bytes = @sizeOf(Cmsghdr) + constants.seg_fd_chunk_count * @sizeOf(i32);

comptime {
    assert(@sizeOf(Reply) == 32);
    assert(@sizeOf(Cmsghdr) == 16);
    assert(control_bytes % 8 == 0);
}

const NameBuffer = [constants.seg_unique_id_max_bytes + 48]u8;

/// The abstract socket address "\0ucm-<unique_id>-<pid>-<index>" and its length.
fn socket_address(unique_id: []const u8, pid: u32, entry_index: u32, address: *linux.sockaddr.un) linux.socklen_t {
    assert(sys.unique_id_valid(unique_id));
    assert(entry_index < constants.seg_attach_entries_max);
    address.* = .{ .family = linux.AF.UNIX, .path = [_]u8{0} ** 108 };
    var name_buffer: NameBuffer = undefined;
    const name = std.fmt.bufPrint(&name_buffer, "ucm-{s}-{d}-{d}", .{ unique_id, pid, entry_index }) catch unreachable;
    assert(name.len + 1 <= address.path.len);
    // path[0] stays 0: the abstract namespace.
    @memcpy(address.path[1 .. 1 + name.len], name);
    return @intCast(@offsetOf(linux.sockaddr.un, "path") + 1 + name.len);
}

fn set_timeouts(fd: i32) void {
    assert(fd >= 0);
    const timeout: Timeval = .{ .sec = constants.seg_socket_timeout_ms / 1000, .usec = (constants.seg_socket_timeout_ms % 1000) * 1000 };
    _ = linux.setsockopt(fd, linux.SOL.SOCKET, linux.SO.RCVTIMEO, std.mem.asBytes(&timeout), @sizeOf(Timeval));
    _ = linux.setsockopt(fd, linux.SOL.SOCKET, linux.SO.SNDTIMEO, std.mem.asBytes(&timeout), @sizeOf(Timeval));
}

pub const Server = struct {
    listen_fd: i32 = -1,
    wake_fd: i32 = -1,
    /// 1 once a stop was requested. Release/acquire: pairs the request with the loop's exit.
    stop: std.atomic.Value(u32) = std.atomic.Value(u32).init(0),
    fds: []const i32 = &.{},
    /// The uid peers must have; our own euid unless a test overrides it. Monotonic accesses:
    /// a standalone setting that orders no other memory.
    expected_uid: std.atomic.Value(u32) = std.atomic.Value(u32).init(0),
    served_count: std.atomic.Value(u32) = std.atomic.Value(u32).init(0),
    refused_count: std.atomic.Value(u32) = std.atomic.Value(u32).init(0),

    /// Binds and listens; connections queue until `serve` runs.
    pub fn start(self: *Server, unique_id: []const u8, pid: u32, entry_index: u32, fds: []const i32, diag: *Diag) SegError!void {
        assert(self.listen_fd == -1);
        assert(fds.len > 0 and fds.len <= constants.seg_segments_max);
        const socket_rc = linux.socket(linux.AF.UNIX, linux.SOCK.SEQPACKET | linux.SOCK.CLOEXEC | linux.SOCK.NONBLOCK, 0);
        if (sys.errno(socket_rc) != .SUCCESS) return diag.fail(error.System, "cannot create the fd server socket: {s}", .{@tagName(sys.errno(socket_rc))});
        const listen_fd: i32 = @intCast(socket_rc);
        var address: linux.sockaddr.un = undefined;
        const address_len = socket_address(unique_id, pid, entry_index, &address);
        const bind_rc = linux.bind(listen_fd, @ptrCast(&address), address_len);
        if (sys.errno(bind_rc) != .SUCCESS) {
            sys.close_fd(listen_fd);
            return diag.fail(error.System, "cannot bind the fd server socket @ucm-{s}-{d}-{d}: {s}", .{ unique_id, pid, entry_index, @tagName(sys.errno(bind_rc)) });
        }
        const listen_rc = linux.listen(listen_fd, 64);
        if (sys.errno(listen_rc) != .SUCCESS) {
            sys.close_fd(listen_fd);
            return diag.fail(error.System, "cannot listen on the fd server socket: {s}", .{@tagName(sys.errno(listen_rc))});
        }
        const wake_rc = linux.eventfd(0, linux.EFD.CLOEXEC | linux.EFD.NONBLOCK);
        if (sys.errno(wake_rc) != .SUCCESS) {
            sys.close_fd(listen_fd);
            return diag.fail(error.System, "cannot create the fd server eventfd: {s}", .{@tagName(sys.errno(wake_rc))});
        }
        self.listen_fd = listen_fd;
        self.wake_fd = @intCast(wake_rc);
        self.fds = fds;
        self.expected_uid.store(linux.geteuid(), .monotonic);
        assert(self.listen_fd >= 0);
    }

    pub fn started(self: *const Server) bool {
        return self.listen_fd >= 0;
    }

    /// Serves until `request_stop`. Each pass waits at most seg_server_poll_ms, so even a lost
    /// wake-up only delays the exit, and handles at most one connection.
    pub fn serve(self: *Server) void {
        assert(self.listen_fd >= 0);
        assert(self.wake_fd >= 0);
        // Acquire: pairs with the release in request_stop.
        while (self.stop.load(.acquire) == 0) {
            var poll_fds = [_]linux.pollfd{
                .{ .fd = self.listen_fd, .events = linux.POLL.IN, .revents = 0 },
                .{ .fd = self.wake_fd, .events = linux.POLL.IN, .revents = 0 },
            };
            const rc = linux.poll(&poll_fds, poll_fds.len, constants.seg_server_poll_ms);
            if (sys.errno(rc) != .SUCCESS or rc == 0) continue;
            if (poll_fds[1].revents != 0) continue;
            if (poll_fds[0].revents & linux.POLL.IN == 0) continue;
            const accept_rc = linux.accept4(self.listen_fd, null, null, linux.SOCK.CLOEXEC);
            if (sys.errno(accept_rc) != .SUCCESS) continue;
            const connection: i32 = @intCast(accept_rc);
            self.handle(connection);
            sys.close_fd(connection);
        }
    }

    fn handle(self: *Server, connection: i32) void {
        assert(connection >= 0);
        assert(self.fds.len > 0);
        set_timeouts(connection);
        var credentials: Ucred = undefined;
        var credentials_len: linux.socklen_t = @sizeOf(Ucred);
        const cred_rc = linux.getsockopt(connection, linux.SOL.SOCKET, linux.SO.PEERCRED, std.mem.asBytes(&credentials), &credentials_len);
        const expected_uid = self.expected_uid.load(.monotonic);
        var reply: Reply = .{
            .magic = reply_magic,
            .status = @intFromEnum(Status.ok),
            .segment_count = @intCast(self.fds.len),
            .first_index = 0,
            .chunk_count = 0,
            .peer_uid = credentials.uid,
            .expected_uid = expected_uid,
            .reserved = 0,
        };
        if (sys.errno(cred_rc) != .SUCCESS or credentials.uid != expected_uid) {
            reply.status = @intFromEnum(Status.refused_uid);
            if (sys.errno(cred_rc) != .SUCCESS) reply.peer_uid = std.math.maxInt(u32);
            // Monotonic: a statistic, orders nothing.
            _ = self.refused_count.fetchAdd(1, .monotonic);
            _ = send_reply(connection, &reply, &.{});
            return;
        }
        var first: u32 = 0;
        // Bounded: seg_segments_max / seg_fd_chunk_count messages at most.
        while (first < self.fds.len) {
            const chunk: u32 = @intCast(@min(self.fds.len - first, constants.seg_fd_chunk_count));
            reply.first_index = first;
            reply.chunk_count = chunk;
            if (!send_reply(connection, &reply, self.fds[first .. first + chunk])) return;
            first += chunk;
        }
        _ = self.served_count.fetchAdd(1, .monotonic);
    }

    pub fn request_stop(self: *Server) void {
        assert(self.wake_fd >= 0);
        // Release: the loop that observes the flag also observes everything before the stop.
        self.stop.store(1, .release);
        const one: u64 = 1;
        _ = linux.write(self.wake_fd, std.mem.asBytes(&one), @sizeOf(u64));
    }

    /// Closes the sockets; `serve` must have returned (or never run).
    pub fn deinit(self: *Server) void {
        assert(self.listen_fd >= 0);
        assert(self.wake_fd >= 0);
        sys.close_fd(self.listen_fd);
        sys.close_fd(self.wake_fd);
        self.listen_fd = -1;
        self.wake_fd = -1;
    }
};

fn send_reply(connection: i32, reply: *const Reply, fds: []const i32) bool {
    assert(connection >= 0);
    assert(fds.len <= constants.seg_fd_chunk_count);
    var control: [control_bytes]u8 align(8) = undefined;
    const iov = [_]std.posix.iovec_const{.{ .base = std.mem.asBytes(reply).ptr, .len = @sizeOf(Reply) }};
    var message: linux.msghdr_const = .{ .name = null, .namelen = 0, .iov = &iov, .iovlen = 1, .control = null, .controllen = 0, .flags = 0 };
    if (fds.len > 0) {
        const header: *Cmsghdr = @ptrCast(&control);
        header.* = .{ .len = @sizeOf(Cmsghdr) + fds.len * @sizeOf(i32), .level = linux.SOL.SOCKET, .type = scm_rights };
        @memcpy(control[@sizeOf(Cmsghdr)..][0 .. fds.len * @sizeOf(i32)], std.mem.sliceAsBytes(fds));
        message.control = &control;
        message.controllen = @sizeOf(Cmsghdr) + std.mem.alignForward(usize, fds.len * @sizeOf(i32), 8);
    }
    const rc = linux.sendmsg(connection, &message, linux.MSG.NOSIGNAL);
    return sys.errno(rc) == .SUCCESS and rc == @sizeOf(Reply);
}

/// Connects to the server of (pid, entry_index) and receives `out.len` descriptors.
pub fn fetch(unique_id: []const u8, pid: u32, entry_index: u32, out: []i32, diag: *Diag) SegError!void {
    assert(out.len > 0 and out.len <= constants.seg_segments_max);
    assert(sys.unique_id_valid(unique_id));
    @memset(out, -1);
    const socket_rc = linux.socket(linux.AF.UNIX, linux.SOCK.SEQPACKET | linux.SOCK.CLOEXEC, 0);
    if (sys.errno(socket_rc) != .SUCCESS) return diag.fail(error.System, "cannot create a socket: {s}", .{@tagName(sys.errno(socket_rc))});
    const fd: i32 = @intCast(socket_rc);
    defer sys.close_fd(fd);
    set_timeouts(fd);
    var address: linux.sockaddr.un = undefined;
    const address_len = socket_address(unique_id, pid, entry_index, &address);
    const connect_rc = linux.connect(fd, @ptrCast(&address), address_len);
    if (sys.errno(connect_rc) != .SUCCESS) {
        return diag.fail(error.System, "cannot reach the fd server of pid {d}: {s}", .{ pid, @tagName(sys.errno(connect_rc)) });
    }
    var received: u32 = 0;
    var messages: u32 = 0;
    errdefer close_received(out);
    // Bounded: one message per chunk, and each recvmsg by SO_RCVTIMEO.
    while (received < out.len) : (messages += 1) {
        if (messages > constants.seg_segments_max / constants.seg_fd_chunk_count) {
            return diag.fail(error.System, "the fd server of pid {d} sent too many messages", .{pid});
        }
        var reply: Reply = undefined;
        var control: [control_bytes]u8 align(8) = undefined;
        var iov = [_]std.posix.iovec{.{ .base = std.mem.asBytes(&reply).ptr, .len = @sizeOf(Reply) }};
        var message: linux.msghdr = .{ .name = null, .namelen = 0, .iov = &iov, .iovlen = 1, .control = &control, .controllen = control.len, .flags = 0 };
        const rc = linux.recvmsg(fd, &message, msg_cmsg_cloexec);
        if (sys.errno(rc) != .SUCCESS) {
            return diag.fail(error.Timeout, "no answer from the fd server of pid {d}: {s}", .{ pid, @tagName(sys.errno(rc)) });
        }
        const fd_count = take_fds(&message, &control, out, received);
        if (rc != @sizeOf(Reply) or reply.magic != reply_magic) {
            return diag.fail(error.System, "the fd server of pid {d} sent a malformed reply ({d} bytes)", .{ pid, rc });
        }
        if (reply.status == @intFromEnum(Status.refused_uid)) {
            return diag.fail(error.Permission, "the fd server of pid {d} refused to hand out the data segments: peer uid {d} is not its uid {d} (only processes of the same user may attach)", .{ pid, reply.peer_uid, reply.expected_uid });
        }
        const consistent = reply.status == @intFromEnum(Status.ok) and reply.segment_count == out.len and
            reply.first_index == received and reply.chunk_count == fd_count and fd_count > 0 and
            message.flags & msg_ctrunc == 0;
        if (!consistent) {
            return diag.fail(error.Mismatch, "the fd server of pid {d} sent {d} descriptors from index {d} of {d}, this process expects {d} segments", .{ pid, fd_count, reply.first_index, reply.segment_count, out.len });
        }
        received += fd_count;
    }
    assert(received == out.len);
}

/// Copies the SCM_RIGHTS descriptors of `message` into out[first..]; closes any that do not fit.
fn take_fds(message: *const linux.msghdr, control: []align(8) const u8, out: []i32, first: u32) u32 {
    assert(first <= out.len);
    if (message.controllen < @sizeOf(Cmsghdr)) return 0;
    const header: *const Cmsghdr = @ptrCast(control.ptr);
    if (header.level != linux.SOL.SOCKET or header.type != scm_rights) return 0;
    assert(header.len <= control.len);
    const count: u32 = @intCast((header.len - @sizeOf(Cmsghdr)) / @sizeOf(i32));
    const fds_bytes = control[@sizeOf(Cmsghdr)..][0 .. count * @sizeOf(i32)];
    var index: u32 = 0;
    while (index < count) : (index += 1) {
        const fd = std.mem.readInt(i32, fds_bytes[index * 4 ..][0..4], .little);
        if (first + index < out.len) out[first + index] = fd else sys.close_fd(fd);
    }
    return count;
}

fn close_received(out: []i32) void {
    assert(out.len <= constants.seg_segments_max);
    for (out) |*fd| {
        if (fd.* >= 0) sys.close_fd(fd.*);
        fd.* = -1;
    }
}

test "fds pass to a same-uid client and a uid mismatch is refused" {
    var diag_buffer: [512]u8 = undefined;
    var diag = Diag.init(&diag_buffer);
    var fds: [3]i32 = undefined;
    for (&fds, 0..) |*fd, index| {
        fd.* = @intCast(linux.memfd_create("ucm-fdpass-test", linux.MFD.CLOEXEC));
        _ = linux.ftruncate(fd.*, @intCast(4096 * (index + 1)));
    }
    defer for (fds) |fd| sys.close_fd(fd);
    const pid: u32 = @intCast(linux.getpid());
    var server: Server = .{};
    try server.start("zigtest-fdpass", pid, 5, &fds, &diag);
    defer server.deinit();
    const thread = try std.Thread.spawn(.{}, Server.serve, .{&server});
    var got: [3]i32 = undefined;
    try fetch("zigtest-fdpass", pid, 5, &got, &diag);
    for (got, 0..) |fd, index| {
        var st: linux.Stat = undefined;
        try std.testing.expectEqual(@as(usize, 0), linux.fstat(fd, &st));
        try std.testing.expectEqual(@as(i64, @intCast(4096 * (index + 1))), st.size);
        sys.close_fd(fd);
    }
    server.expected_uid.store(linux.geteuid() + 1, .monotonic);
    try std.testing.expectError(error.Permission, fetch("zigtest-fdpass", pid, 5, &got, &diag));
    try std.testing.expect(std.mem.indexOf(u8, diag.message(), "refused") != null);
    try std.testing.expectEqual(@as(u32, 1), server.refused_count.load(.monotonic));
    try std.testing.expectEqual(@as(u32, 1), server.served_count.load(.monotonic));
    const start_ns = sys.monotonic_ns();
    server.request_stop();
    thread.join();
    try std.testing.expect(sys.monotonic_ns() - start_ns < 200 * std.time.ns_per_ms);
    try std.testing.expectError(error.System, fetch("zigtest-fdpass", pid, 6, &got, &diag));
}
