// A small worker pool for the kernels' row chunks, built for shared, oversubscribed CPUs.
//
// torch's OpenMP pool (at::parallel_for) ends every region with a barrier that waits for every
// team thread, and its idle threads spin between regions. On a 2-core machine shared with
// other processes that costs more than the second thread brings: a descheduled worker holds up
// each join for a scheduler time slice, and a spinning one takes the CPU the calling thread
// needs for the Python between kernel calls (measured under load: two threads far slower
// than one; see bench/README.md). Here:
//   - the caller publishes a job and works on it itself; chunks are claimed from an atomic
//     counter, so whoever runs does the work;
//   - the caller waits only for chunks a worker has already claimed, never for a worker to
//     arrive; a worker that wakes late finds nothing left (or a newer job, whose chunks it may
//     then help with) and goes back to waiting;
//   - idle workers spin briefly (catching the next call of a decode step), then sleep on a
//     condition variable;
//   - one job at a time: a second caller (another Python thread) runs its job serially;
//   - after fork() the child builds a new pool (the parent's threads do not exist there).
#pragma once

#include <immintrin.h>
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace efs {

class Pool {
public:
    using Fn = void (*)(void* ctx, int64_t chunk);

    Pool(int workers, int64_t spin_us) : spin_us_(spin_us) {
        for (int i = 0; i < workers; ++i) threads_.emplace_back([this] { loop(); });
    }

    ~Pool() {
        {
            std::lock_guard<std::mutex> g(m_);
            stop_.store(true);
            wake_.fetch_add(1);
        }
        cv_.notify_all();
        for (auto& t : threads_) t.join();
    }

    int workers() const { return (int)threads_.size(); }

    // Runs fn(ctx, c) for c in [0, n); returns when all are done. Thread-safe.
    void run(int64_t n, Fn fn, void* ctx) {
        std::unique_lock<std::mutex> busy(job_m_, std::try_to_lock);
        if (!busy.owns_lock() || threads_.empty() || n <= 1) {
            for (int64_t c = 0; c < n; ++c) fn(ctx, c);
            return;
        }
        // The claim word holds (job << 32 | next chunk) and the job's parameters sit in the slot
        // of the job's parity: a chunk is claimed only by a CAS on the current job's word, the
        // slot was written before that word was published, and it is not rewritten before two
        // jobs later, by when every chunk of this one is done. A worker holding an older word
        // fails its CAS.
        const uint64_t job = ++job_;
        Job& J = slots_[job & 1];
        J.fn.store(fn, std::memory_order_relaxed);
        J.ctx.store(ctx, std::memory_order_relaxed);
        J.n.store(n, std::memory_order_relaxed);
        done_.store(0, std::memory_order_relaxed);
        claim_.store(job << 32, std::memory_order_release);
        {
            std::lock_guard<std::mutex> g(m_);    // no lost wake-up for a worker about to sleep
            wake_.fetch_add(1, std::memory_order_release);
        }
        if (sleepers_.load(std::memory_order_acquire) > 0) cv_.notify_all();
        work();
        while (done_.load(std::memory_order_acquire) < n) _mm_pause();
    }

private:
    void work() {
        for (;;) {
            uint64_t v = claim_.load(std::memory_order_acquire);
            const Job& J = slots_[(v >> 32) & 1];
            const int64_t n = J.n.load(std::memory_order_relaxed);
            const Fn fn = J.fn.load(std::memory_order_relaxed);
            void* const ctx = J.ctx.load(std::memory_order_relaxed);
            const int64_t c = (int64_t)(v & 0xffffffffu);
            if (c >= n) return;
            if (!claim_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel)) continue;
            fn(ctx, c);
            done_.fetch_add(1, std::memory_order_release);
        }
    }

    void loop() {
        // Not wake_'s value when the thread first runs: a pool destroyed before then has
        // already counted its stop in wake_, and a worker that took that count as "seen"
        // slept through it while ~Pool joined it (a pool rebuilt at once by set_spin_us).
        uint64_t seen = 0;
        for (;;) {
            const auto t0 = std::chrono::steady_clock::now();
            while (wake_.load(std::memory_order_acquire) == seen) {
                if (std::chrono::steady_clock::now() - t0 > std::chrono::microseconds(spin_us_)) {
                    std::unique_lock<std::mutex> lk(m_);
                    sleepers_.fetch_add(1);
                    cv_.wait(lk, [&] { return wake_.load() != seen; });
                    sleepers_.fetch_sub(1);
                    break;
                }
                for (int i = 0; i < 16; ++i) _mm_pause();
            }
            seen = wake_.load(std::memory_order_acquire);
            if (stop_.load()) return;
            work();
        }
    }

    std::vector<std::thread> threads_;
    const int64_t spin_us_;
    std::mutex job_m_;                    // one job at a time
    std::mutex m_;
    std::condition_variable cv_;
    std::atomic<uint64_t> wake_{0};
    std::atomic<int> sleepers_{0};
    std::atomic<bool> stop_{false};
    struct Job {
        std::atomic<Fn> fn{nullptr};
        std::atomic<void*> ctx{nullptr};
        std::atomic<int64_t> n{0};
    };
    uint64_t job_ = 0;                    // caller side only (under job_m_)
    Job slots_[2];
    std::atomic<uint64_t> claim_{0};
    std::atomic<int64_t> done_{0};
};

}  // namespace efs
