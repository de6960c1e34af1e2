"""A FUSE file system of one file, ``f``, whose daemon stops answering GETATTR of it once told to (``stall``): a
user's FUSE mount (fusermount3) can make any stat that follows a link to the file wait for ever. Root only (it opens
/dev/fuse and mounts): use it in a mount namespace of its own. Usage: ``fs = StallFs(dir); ...; fs.close()``"""
import ctypes
import os
import struct
import threading

IN_HDR = struct.Struct("=IIQQIIIHH")  # len, opcode, unique, nodeid, uid, gid, pid, total_extlen, padding
OUT_HDR = struct.Struct("=IiQ")
# fuse_attr: ino size blocks atime mtime ctime, their ns, mode nlink uid gid rdev blksize flags
ATTR = struct.Struct("=QQQQQQIIIIIIIIII")


def _attr(ino, mode):
    return ATTR.pack(ino, 0, 0, 0, 0, 0, 0, 0, 0, mode, 1, 0, 0, 0, 4096, 0)


class StallFs:
    def __init__(self, mountpoint):
        self.mnt = mountpoint
        self.stall = threading.Event()
        self.stalled: list[int] = []
        self.fd = os.open("/dev/fuse", os.O_RDWR)
        libc = ctypes.CDLL(None, use_errno=True)
        opts = f"fd={self.fd},rootmode=40000,user_id=0,group_id=0,allow_other".encode()
        if libc.mount(b"stallfs", mountpoint.encode(), b"fuse", 0, opts) != 0:
            raise OSError(ctypes.get_errno(), "mount fuse")
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _reply(self, unique, body=b"", error=0):
        os.write(self.fd, OUT_HDR.pack(OUT_HDR.size + len(body), error, unique) + body)

    def _serve(self):
        while True:
            try:
                req = os.read(self.fd, 1 << 20)
            except OSError:
                return
            _, op, unique, node = IN_HDR.unpack_from(req)[:4]
            if op == 26:  # INIT
                self._reply(unique, struct.pack("=IIIIHHI", 7, 19, 0, 0, 0, 0, 4096))
            elif op == 1:  # LOOKUP
                self._reply(unique, struct.pack("=QQQQII", 2, 0, 0, 0, 0, 0) + _attr(2, 0o100644))
            elif op == 3:  # GETATTR
                if node == 2 and self.stall.is_set():
                    self.stalled.append(unique)  # answered only at close
                    continue
                self._reply(unique, struct.pack("=QII", 0, 0, 0) + _attr(node, 0o40755 if node == 1 else 0o100644))
            elif op in (14, 27):  # OPEN, OPENDIR
                self._reply(unique, struct.pack("=QII", 0, 0, 0))
            elif op in (18, 29, 25, 22):  # RELEASE, RELEASEDIR, FLUSH, ACCESS
                self._reply(unique)
            else:
                self._reply(unique, error=-38)  # ENOSYS

    def close(self):
        """Answer the stalled requests (ENOTCONN), unmount, close."""
        self.stall.clear()
        for unique in self.stalled:
            self._reply(unique, error=-107)
        ctypes.CDLL(None, use_errno=True).umount2(self.mnt.encode(), 2)  # MNT_DETACH
        os.close(self.fd)
