//! The embedded store's database handle, reopened after an I/O error. After one failed write
//! (a full disk, say) redb refuses every later operation with `PreviousIo` until the file is
//! closed and opened again; without this, memory would stay unavailable until a restart even
//! after the disk has room again.

use std::fs::OpenOptions;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use redb::backends::FileBackend;
use redb::{Database, StorageBackend, StorageError, TransactionError};

use engram_runtime::error::{Error, Result};
use engram_runtime::priority;

/// How long a reopen waits for operations still holding the failed handle to let go of it.
const RELEASE_WAIT: Duration = Duration::from_secs(2);

pub struct DbHandle {
    /// `None` for an in-memory database, which has no file to reopen (and no I/O to fail).
    path: Option<PathBuf>,
    /// `None` between taking a failed database out of service and opening it again.
    current: RwLock<Option<Arc<Database>>>,
    /// One reopen at a time.
    reopening: Mutex<()>,
    /// Tables created whenever the file is opened, so reads never meet a missing one.
    create_tables: fn(&Database) -> Result<()>,
}

impl DbHandle {
    /// Opens (or creates) the database file. Blocking.
    pub fn open(path: &Path, create_tables: fn(&Database) -> Result<()>) -> Result<DbHandle> {
        let db = open_database(path, create_tables)?;
        Ok(DbHandle {
            path: Some(path.to_owned()),
            current: RwLock::new(Some(Arc::new(db))),
            reopening: Mutex::new(()),
            create_tables,
        })
    }

    /// A database in memory, lost with the process.
    pub fn in_memory(create_tables: fn(&Database) -> Result<()>) -> Result<DbHandle> {
        let db = Database::builder()
            .set_cache_size(CACHE_BYTES)
            .create_with_backend(redb::backends::InMemoryBackend::new())
            .map_err(|error| Error::Store(error.to_string()))?;
        create_tables(&db)?;
        Ok(DbHandle {
            path: None,
            current: RwLock::new(Some(Arc::new(db))),
            reopening: Mutex::new(()),
            create_tables,
        })
    }

    /// The database file; `None` in memory.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// The open database; `None` while it is out of service. Never blocks on a reopen.
    pub fn current(&self) -> Option<Arc<Database>> {
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The open database, reopening the file first if it is out of service. Blocking.
    pub fn get_or_reopen(&self) -> Result<Arc<Database>> {
        match self.current() {
            Some(db) => Ok(db),
            None => self.reopen(),
        }
    }

    /// After an operation on `db` failed with a store error: if redb has refused the database
    /// since (an earlier I/O error), takes it out of service and opens the file again. Blocking.
    pub fn recover(&self, db: Arc<Database>) {
        let Some(path) = &self.path else {
            return;
        };
        if !matches!(
            db.begin_write(),
            Err(TransactionError::Storage(StorageError::PreviousIo))
        ) {
            return;
        }
        tracing::warn!(path = %path.display(), "the embedded store failed an I/O operation; reopening it");
        {
            let mut current = self.current.write().unwrap_or_else(PoisonError::into_inner);
            if current.as_ref().is_some_and(|open| Arc::ptr_eq(open, &db)) {
                *current = None;
            }
        }
        drop(db);
        if let Err(error) = self.reopen() {
            tracing::warn!(%error, "reopening the embedded store failed; the next operation tries again");
        }
    }

    fn reopen(&self) -> Result<Arc<Database>> {
        let Some(path) = &self.path else {
            return Err(Error::Store("the in-memory store is closed".to_owned()));
        };
        let _one_at_a_time = self
            .reopening
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(db) = self.current() {
            return Ok(db);
        }
        // Operations that still hold the failed handle fail fast and drop it; until they have,
        // redb's file lock makes the open fail with `DatabaseAlreadyOpen`.
        let started = Instant::now();
        let db = loop {
            match open_database(path, self.create_tables) {
                Ok(db) => break db,
                Err(error) if started.elapsed() < RELEASE_WAIT => {
                    tracing::debug!(%error, "the failed store handle is still in use");
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(error) => return Err(error),
            }
        };
        let db = Arc::new(db);
        *self.current.write().unwrap_or_else(PoisonError::into_inner) = Some(Arc::clone(&db));
        tracing::info!(path = %path.display(), "the embedded store is open again");
        Ok(db)
    }
}

/// redb's own page cache. redb moves every page a commit wrote into it, up to its default of
/// 1 GiB, so a long-running proxy's memory would grow with its file up to that; the kernel's
/// page cache holds the file anyway, and what the hot path reads (versions, prefetched
/// candidates, the tree's upper pages) is a small part of it. Measured with 1,000 streams in
/// flight for 20 s and the backlog drained (~19,000 jobs, a 125 MB file): 8 MiB against 32 MiB
/// took peak RSS from 237-251 to 196-217 MB at the same drain time (65-67 s).
const CACHE_BYTES: usize = 8 * 1024 * 1024;

fn open_database(path: &Path, create_tables: fn(&Database) -> Result<()>) -> Result<Database> {
    // As redb's `Builder::create` opens it, with the file behind `YieldingFile`.
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|error| Error::Store(error.to_string()))?;
    let backend = FileBackend::new(file).map_err(|error| Error::Store(error.to_string()))?;
    let db = Database::builder()
        .set_cache_size(CACHE_BYTES)
        .create_with_backend(YieldingFile(backend))
        .map_err(|error| Error::Store(error.to_string()))?;
    create_tables(&db)?;
    Ok(db)
}

/// redb's file backend, giving the core to a waiting request thread while a background thread
/// (the recorder's, the worker's) commits: at a page read or write once the thread has run a
/// slice, and before each sync. On a kernel without preemption, a recorder is not taken off the
/// core when a request thread wakes: in a 3 s `perf sched` trace at 2,000 req/s with memory
/// on, the recorder was running during 92 % of the time request threads spent runnable but
/// waiting (waits over 0.5 ms). With the writes' yields and a checkpoint per write of a group
/// commit, the added p99 there fell from a median of 3.4 to 2.6 ms over four paired runs; with
/// the reads' (redb's cache misses) and a clock read at each, and the recorder no longer
/// niced, to 1.3 ms over five (docs/benchmarks-log.md). On other threads (a request thread's read)
/// it is redb's own.
#[derive(Debug)]
struct YieldingFile(FileBackend);

impl StorageBackend for YieldingFile {
    fn len(&self) -> io::Result<u64> {
        self.0.len()
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
        priority::checkpoint_step();
        self.0.read(offset, out)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.0.set_len(len)
    }

    fn sync_data(&self) -> io::Result<()> {
        priority::yield_if_background();
        self.0.sync_data()
    }

    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        priority::checkpoint_step();
        self.0.write(offset, data)
    }

    fn close(&self) -> io::Result<()> {
        self.0.close()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use redb::{ReadableDatabase, TableDefinition};

    use super::*;

    const ROWS: TableDefinition<u64, u64> = TableDefinition::new("rows");

    /// A commit on a background thread yields (before its sync at least), so a request thread
    /// waiting for the core gets it; the file is redb's as before.
    #[test]
    fn a_background_threads_commit_yields_and_the_file_reopens() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("yield.redb");
        let handle = DbHandle::open(&path, |_| Ok(())).unwrap();
        let db = handle.get_or_reopen().unwrap();
        std::thread::spawn(move || {
            let long_ago = Instant::now().checked_sub(Duration::from_secs(1)).unwrap();
            priority::start_slice(long_ago);
            let txn = db.begin_write().unwrap();
            txn.open_table(ROWS).unwrap().insert(1, 2).unwrap();
            txn.commit().unwrap();
            assert!(
                engram_memory::yielding::last_yield().unwrap() > long_ago,
                "the commit never yielded"
            );
        })
        .join()
        .unwrap();
        drop(handle);
        let reopened = open_database(&path, |_| Ok(())).unwrap();
        let txn = reopened.begin_read().unwrap();
        let rows = txn.open_table(ROWS).unwrap();
        assert_eq!(rows.get(1).unwrap().unwrap().value(), 2);
    }
}
