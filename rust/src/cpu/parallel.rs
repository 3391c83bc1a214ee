//! Fork-join for the CPU kernels, on the OpenMP thread pool torch already runs when there is one.
//!
//! After each parallel op torch's OpenMP workers spin for a while waiting for the next one. A
//! kernel that starts its own threads right after a torch op gets its second thread time-sliced
//! against a spinning worker on the same core: measured on a 2-core box, the decode kernel was
//! no faster with two threads than with one. Handing the work to that spinning worker instead
//! (the way ATen's own `parallel_for` does) makes the second thread real. The runtime is the one
//! torch's `libtorch_cpu` links (a process can hold several libgomp copies, e.g. sentencepiece
//! bundles its own, and a second pool would spin against the first); it is looked up among the
//! libraries already mapped, never loaded by us. Without it, scoped std threads do the work.

/// Run `task(part)` for every `part in 0..parts`, each on some thread of a team of at most
/// `parts` threads. `task` must not panic (it runs inside foreign code).
pub fn run_parts(parts: usize, task: &(dyn Fn(usize) + Sync)) {
    if parts <= 1 {
        (0..parts).for_each(task);
        return;
    }
    #[cfg(target_os = "linux")]
    if let Some(omp) = openmp::runtime() {
        return omp.run(parts, task);
    }
    std::thread::scope(|scope| {
        for part in 1..parts {
            scope.spawn(move || task(part));
        }
        task(0);
    });
}

/// `"openmp"` when the kernels run on torch's OpenMP pool, `"threads"` when on their own.
pub fn runtime_name() -> &'static str {
    #[cfg(target_os = "linux")]
    if openmp::runtime().is_some() {
        return "openmp";
    }
    "threads"
}

#[cfg(target_os = "linux")]
mod openmp {
    use std::ffi::{c_int, c_uint, c_void, CString};
    use std::sync::OnceLock;

    type Body = unsafe extern "C" fn(*mut c_void);
    type Parallel = unsafe extern "C" fn(Body, *mut c_void, c_uint, c_uint);
    type Query = unsafe extern "C" fn() -> c_int;

    /// libgomp's entry points (the GCC OpenMP ABI, which torch's Linux wheels ship).
    pub struct Runtime {
        parallel: Parallel,
        thread_num: Query,
        num_threads: Query,
    }

    struct Job<'a> {
        parts: usize,
        task: &'a (dyn Fn(usize) + Sync),
        rt: &'a Runtime,
    }

    unsafe extern "C" fn body(data: *mut c_void) {
        // SAFETY: `data` is the `Job` that `run` passes in and keeps alive for the whole region,
        // and the two queries are valid inside it.
        let job = unsafe { &*(data as *const Job) };
        let (me, team) = unsafe {
            (
                (job.rt.thread_num)() as usize,
                (job.rt.num_threads)().max(1) as usize,
            )
        };
        // The team can be smaller than asked for (nesting, limits): deal the parts round-robin.
        (me..job.parts).step_by(team).for_each(job.task);
    }

    impl Runtime {
        pub fn run(&self, parts: usize, task: &(dyn Fn(usize) + Sync)) {
            let job = Job {
                parts,
                task,
                rt: self,
            };
            // SAFETY: GOMP_parallel runs `body` on every team thread (the caller included) and
            // returns only after all of them finish, so `job` outlives every use.
            unsafe { (self.parallel)(body, &job as *const Job as *mut c_void, parts as c_uint, 0) };
        }
    }

    pub fn runtime() -> Option<&'static Runtime> {
        static RUNTIME: OnceLock<Option<Runtime>> = OnceLock::new();
        RUNTIME.get_or_init(find).as_ref()
    }

    fn find() -> Option<Runtime> {
        let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
        let path = maps
            .lines()
            .filter_map(|l| l.split_whitespace().nth(5))
            .find(|p| {
                p.rsplit('/')
                    .next()
                    .is_some_and(|f| f.starts_with("libtorch_cpu"))
            })?;
        let path = CString::new(path).ok()?;
        // SAFETY: RTLD_NOLOAD only returns a handle to a library that is already loaded (so no
        // initialisers run). dlsym on that handle searches libtorch_cpu and then its own
        // dependencies, so it finds the OpenMP runtime torch runs on; the symbols are used with
        // their documented C signatures.
        unsafe {
            let lib = libc::dlopen(path.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD);
            if lib.is_null() {
                return None;
            }
            let sym = |name: &std::ffi::CStr| {
                let p = libc::dlsym(lib, name.as_ptr());
                (!p.is_null()).then_some(p)
            };
            Some(Runtime {
                parallel: std::mem::transmute::<*mut c_void, Parallel>(sym(c"GOMP_parallel")?),
                thread_num: std::mem::transmute::<*mut c_void, Query>(sym(c"omp_get_thread_num")?),
                num_threads: std::mem::transmute::<*mut c_void, Query>(sym(
                    c"omp_get_num_threads",
                )?),
            })
        }
    }
}

#[cfg(test)]
#[path = "parallel_tests.rs"]
mod tests;
