"""A real PostgreSQL server for the tests: the machine's own on 127.0.0.1:5432 when one
answers (trust auth, user ``postgres``), else one started here (``initdb`` and ``pg_ctl``
of Debian's ``postgresql`` package) in a temporary folder on a free port. Each test run
works in a database of its own (a random name, dropped at the end), so runs in parallel
do not meet."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import psycopg
from psycopg import sql

from tests.servers import free_port, wait_for

# Where the machine's own server usually answers.
LOCAL_PORT = 5432
# The user the server runs as when the tests run as root (initdb refuses root).
SERVER_USER = "postgres"


def _binary(name: str) -> str:
    found = shutil.which(name) or next(
        iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None
    )
    assert found, f"{name} is not installed (scripts/install installs postgresql)"
    return found


def answers(port: int) -> bool:
    """Whether a server on ``port`` takes a connection of user postgres without a password."""
    try:
        with psycopg.connect(
            host="127.0.0.1", port=port, user="postgres", dbname="postgres", connect_timeout=2
        ):
            return True
    except psycopg.Error:
        return False


class PostgresServer:
    """One PostgreSQL server: the machine's own (``owned`` False), or one this process
    started and may restart, kill and stop."""

    def __init__(self, port: int, data: Path | None = None) -> None:
        self.port = port
        self.data = data
        self.databases: list[str] = []

    @property
    def owned(self) -> bool:
        return self.data is not None

    @classmethod
    def local_or_started(cls) -> PostgresServer:
        """The machine's server on 127.0.0.1:5432 if it answers, else a new one."""
        if answers(LOCAL_PORT):
            return cls(LOCAL_PORT)
        return cls.started()

    @classmethod
    def started(cls) -> PostgresServer:
        """A new server in a temporary folder, on a free port, fsync off (tests only)."""
        data = Path(tempfile.mkdtemp(prefix="tool-proxy-pg-"))
        server = cls(free_port(), data)
        server._run(_binary("initdb"), "-D", str(data / "db"), "-U", "postgres", "-A", "trust")
        server.start()
        return server

    def _run(self, *args: str) -> None:
        assert self.data is not None
        as_root = os.getuid() == 0
        if as_root:
            user = pwd.getpwnam(SERVER_USER)
            for path in [self.data, *self.data.rglob("*")]:
                os.chown(path, user.pw_uid, user.pw_gid)
        subprocess.run(
            args,
            check=True,
            capture_output=True,
            user=SERVER_USER if as_root else None,
            cwd=self.data,
            timeout=60,
        )

    def _ctl(self, *args: str) -> None:
        assert self.data is not None, "the machine's own server is not the tests' to control"
        self._run(_binary("pg_ctl"), "-D", str(self.data / "db"), "-w", "-t", "30", *args)

    def start(self) -> None:
        assert self.data is not None
        options = (
            f"-p {self.port} -k {self.data} -c listen_addresses=127.0.0.1 -c fsync=off"
            " -c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
        )
        self._ctl("-o", options, "-l", str(self.data / "log"), "start")
        wait_for(lambda: answers(self.port), what="postgres")

    def restart(self) -> None:
        """A fast shutdown (connections cut, committed data kept), then a start."""
        self._ctl("-m", "fast", "stop")
        self.start()

    def kill(self) -> None:
        """An immediate shutdown (as a crash: recovery runs at the next start)."""
        self._ctl("-m", "immediate", "stop")

    def stop(self) -> None:
        for name in list(self.databases):
            self.drop_database(name)
        if self.owned:
            self._ctl("-m", "fast", "stop")
            assert self.data is not None
            shutil.rmtree(self.data, ignore_errors=True)

    def admin(self, dbname: str = "postgres") -> psycopg.Connection[tuple[object, ...]]:
        return psycopg.connect(
            host="127.0.0.1", port=self.port, user="postgres", dbname=dbname, autocommit=True
        )

    def create_database(self) -> str:
        """A new database with a random name (dropped by ``stop``), whose commits do not
        wait for the disk: a commit survives the server's crash (the data is in the OS's
        cache), not the machine's, and the tests need no more."""
        name = f"tool_proxy_test_{uuid.uuid4().hex[:12]}"
        with self.admin() as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            conn.execute(
                sql.SQL("ALTER DATABASE {} SET synchronous_commit = off").format(
                    sql.Identifier(name)
                )
            )
        self.databases.append(name)
        return name

    def drop_database(self, name: str) -> None:
        with self.admin() as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )
        self.databases.remove(name)

    def url(self, dbname: str, **query: str) -> str:
        tail = "&".join(f"{k}={v}" for k, v in query.items())
        base = f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"
        return f"{base}?{tail}" if tail else base

    def empty(self, dbname: str, schema: str = "tool_proxy") -> None:
        """Delete every row of the store's tables (the schema stays: no migration per test),
        in one transaction."""
        with self.admin(dbname) as conn, conn.transaction():
            rows = conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = %s AND tablename <> %s",
                (schema, "schema_version"),
            ).fetchall()
            deletes = [  # DELETE: TRUNCATE makes new files for every table, slower here
                sql.SQL("DELETE FROM {}").format(sql.Identifier(schema, str(r[0]))) for r in rows
            ]
            if deletes:
                conn.execute(sql.SQL("; ").join(deletes))


class PgBouncer:
    """PgBouncer in transaction mode on a free port, in front of ``server``: each
    transaction of a client may run on another server connection."""

    def __init__(self, server: PostgresServer) -> None:
        self.port = free_port()
        folder = Path(tempfile.mkdtemp(prefix="tool-proxy-pgbouncer-"))  # not under a 0700
        self.folder = folder  # folder of root's: pgbouncer runs as postgres
        self.process: subprocess.Popen[bytes] | None = None
        ini = folder / "pgbouncer.ini"
        (folder / "users.txt").write_text('"postgres" ""\n')
        ini.write_text(
            "[databases]\n"
            f"* = host=127.0.0.1 port={server.port}\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\n"
            f"unix_socket_dir =\nauth_type = trust\nauth_file = {folder / 'users.txt'}\n"
            "pool_mode = transaction\ndefault_pool_size = 4\nmin_pool_size = 0\n"
        )
        self.ini = ini

    def start(self) -> PgBouncer:
        binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
        assert os.path.exists(binary), "pgbouncer is not installed (scripts/install does)"
        as_root = os.getuid() == 0
        if as_root:
            user = pwd.getpwnam(SERVER_USER)
            for path in [self.folder, *self.folder.rglob("*")]:
                os.chown(path, user.pw_uid, user.pw_gid)
        self.process = subprocess.Popen(
            [binary, str(self.ini)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            user=SERVER_USER if as_root else None,
        )
        wait_for(lambda: answers(self.port), what="pgbouncer")
        return self

    def url(self, dbname: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)
            self.process = None
        shutil.rmtree(self.folder, ignore_errors=True)
