// A small spinning thread pool for the kernels that a decode step calls dozens of times.
//
// Why not OpenMP (at::parallel_for): libgomp keeps one thread team per thread that starts parallel regions.
// Once a second thread has one (the engine thread runs the model; the main thread loaded it), it counts more
// threads than CPUs and its barriers stop spinning and sleep at once, so every region pays a futex wake-up
// (bench/kernels.py shows the cost). This pool's workers spin for a short, bounded while after each job
// (kSpin), so the next job of the same step starts at once, then sleep on a condition variable.
//
// Spinning is bounded on both sides: workers spin at most kSpin for the next job, and the caller spins at
// most kSpin for the workers to finish a job before it too sleeps until the last one wakes it. A descheduled
// worker (the machine busy with other processes, or another Python thread running while a kernel has
// released the GIL) then costs the caller a wake-up instead of a core burnt spinning.
//
// One job at a time: a caller that finds the pool busy (another thread calling a kernel meanwhile, another
// engine in the process) runs its job on its own thread, which gives the same results (a job's tasks never
// depend on which thread runs them).
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kiln {

class SpinPool {
 public:
  using Job = std::function<void(int64_t begin, int64_t end)>;

  // Runs job over [0, tasks) split into contiguous ranges, one per thread (at::get_num_threads() of the
  // caller, at most one per `grain` tasks); returns when all are done.
  static void run(int64_t tasks, int64_t grain, const Job& job) {
    const int64_t threads = std::min<int64_t>(at::get_num_threads(), (tasks + grain - 1) / std::max<int64_t>(grain, 1));
    if (threads <= 1) {
      if (tasks > 0) job(0, tasks);
      return;
    }
    SpinPool& pool = instance();
    std::unique_lock<std::mutex> busy(pool.busy_, std::try_to_lock);
    if (!busy.owns_lock()) {
      job(0, tasks);
      return;
    }
    pool.dispatch(tasks, threads, job);
  }

 private:
  static constexpr auto kSpin = std::chrono::microseconds(300);

  static SpinPool& instance() {
    // A forked child has none of the parent's threads: it starts a pool of its own (the parent's is leaked).
    static std::atomic<SpinPool*> pool{nullptr};
    static std::mutex creating;
    SpinPool* current = pool.load(std::memory_order_acquire);
    if (current == nullptr || current->pid_ != getpid()) {
      std::lock_guard<std::mutex> lock(creating);
      current = pool.load(std::memory_order_acquire);
      if (current == nullptr || current->pid_ != getpid()) {
        current = new SpinPool();
        pool.store(current, std::memory_order_release);
      }
    }
    return *current;
  }

  void dispatch(int64_t tasks, int64_t threads, const Job& job) {
    while (static_cast<int64_t>(workers_.size()) < threads - 1) {
      const int64_t index = static_cast<int64_t>(workers_.size()) + 1;
      const uint64_t seen = generation_.load(std::memory_order_acquire);  // before this job's
      workers_.emplace_back([this, index, seen] { work(index, seen); });
      workers_.back().detach();
    }
    job_ = &job;
    tasks_ = tasks;
    threads_ = threads;
    // Every worker acknowledges every job, taking part or not, so none can still be reading this job's
    // fields when the next one overwrites them.
    pending_.store(static_cast<int64_t>(workers_.size()), std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(sleep_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    job(0, tasks / threads);
    wait_for_workers();
  }

  // Returns once every worker has acknowledged the job: spinning for up to kSpin, then asleep until the
  // last one's notify (it takes `done_lock_` first, so the wake-up cannot fall between the check and the wait).
  void wait_for_workers() {
    const auto deadline = std::chrono::steady_clock::now() + kSpin;
    while (pending_.load(std::memory_order_acquire) != 0) {
      if (std::chrono::steady_clock::now() >= deadline) {
        std::unique_lock<std::mutex> lock(done_lock_);
        done_.wait(lock, [&] { return pending_.load(std::memory_order_acquire) == 0; });
        return;
      }
      _mm_pause();
    }
  }

  void work(int64_t index, uint64_t seen) {
    for (;;) {
      const auto deadline = std::chrono::steady_clock::now() + kSpin;
      uint64_t now = generation_.load(std::memory_order_acquire);
      while (now == seen && std::chrono::steady_clock::now() < deadline) {
        _mm_pause();
        now = generation_.load(std::memory_order_acquire);
      }
      if (now == seen) {
        std::unique_lock<std::mutex> lock(sleep_);
        wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
        now = generation_.load(std::memory_order_acquire);
      }
      seen = now;
      if (index < threads_) {  // a job for fewer threads leaves the others out
        const int64_t begin = tasks_ * index / threads_, end = tasks_ * (index + 1) / threads_;
        if (begin < end) (*job_)(begin, end);
      }
      if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> lock(done_lock_);
        done_.notify_one();
      }
    }
  }

  const pid_t pid_ = getpid();
  std::mutex busy_;
  std::mutex sleep_;
  std::condition_variable wake_;
  std::mutex done_lock_;
  std::condition_variable done_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> pending_{0};
  const Job* job_ = nullptr;
  int64_t tasks_ = 0;
  int64_t threads_ = 0;
  std::vector<std::thread> workers_;
};

}  // namespace kiln
