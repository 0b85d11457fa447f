// A small pool for kernel calls too short for Python threads (a decode step's linears take 10-100 us
// each; handing work to a Python thread costs about that much). A call's parts are claimed from one
// counter by the caller and the workers alike, so when a worker is slow to wake or has lost its core
// to another process (prefill and decode share cores), the caller takes the parts it has not
// claimed instead of waiting for it. Between calls a worker polls the job counter for SPIN_US, yielding
// its core to any other runnable thread between polls, so the calls of one decode step find it awake
// without starving other processes; then it sleeps on a condition variable (an idle server
// costs nothing); the caller yields its core while it waits for a part a worker is computing. One
// call at a time (a mutex); a forked child starts a pool of its own.
#pragma once
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

class ThreadPool {
   public:
    static const int SPIN_US = 100;

    // fn(part) for part = 0 .. parts - 1 on up to `threads` threads, the caller's among them; returns
    // when all are done
    void run(int parts, int threads, const std::function<void(int)>& fn) {
        if (threads <= 1 || parts <= 1 || parts > 0xffff) {
            for (int part = 0; part < parts; ++part) fn(part);
            return;
        }
        std::lock_guard<std::mutex> call(call_mutex_);
        ensure(threads - 1);
        {
            std::lock_guard<std::mutex> lock(mutex_);
            fn_ = &fn;
            pending_.store(parts);
            // the ticket counter carries (job, parts, next part): a late worker's draw can only
            // ever be a part of the job it names, whose fn_ it then sees
            ++jobs_;
            next_.store(jobs_ << 40 | (uint64_t)parts << 24);
            job_.store(jobs_, std::memory_order_release);
        }
        wake_.notify_all();
        claim_parts();
        for (int spins = 0; pending_.load(std::memory_order_acquire) > 0; ++spins) {
            if (spins < 200) pause();
            else std::this_thread::yield();  // the worker holding the last part lost its core: let it run
        }
    }

   private:
    static void pause() {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    }

    void ensure(int workers) {
        if (owner_ != getpid()) {  // a forked child has none of the parent's threads: start over
            // their handles refer to threads of another process: never joined, detached or destroyed
            new std::vector<std::thread>(std::move(threads_));
            threads_.clear();
            owner_ = getpid();
        }
        const uint64_t seen = job_.load();  // the job about to be published is new to them
        while ((int)threads_.size() < workers) threads_.emplace_back([this, seen] { work(seen); });
    }

    void work(uint64_t seen) {
        for (;;) {
            const auto start = std::chrono::steady_clock::now();
            while (job_.load(std::memory_order_acquire) == seen) {
                std::this_thread::yield();  // awake, but any other runnable thread (the router, a prefill) goes first
                if (std::chrono::steady_clock::now() - start > std::chrono::microseconds(SPIN_US)) {
                    std::unique_lock<std::mutex> lock(mutex_);
                    wake_.wait(lock, [&] { return job_.load(std::memory_order_acquire) != seen; });
                }
            }
            seen = job_.load(std::memory_order_acquire);
            claim_parts();
        }
    }

    void claim_parts() {  // run unclaimed parts of the current job until none is left
        for (;;) {
            const uint64_t ticket = next_.fetch_add(1);
            const int parts = (int)(ticket >> 24 & 0xffff), part = (int)(ticket & 0xffffff);
            if (part >= parts) return;
            (*fn_)(part);
            pending_.fetch_sub(1, std::memory_order_release);
        }
    }

    std::mutex call_mutex_, mutex_;
    std::condition_variable wake_;
    std::vector<std::thread> threads_;
    pid_t owner_ = -1;
    const std::function<void(int)>* fn_ = nullptr;
    uint64_t jobs_ = 0;
    std::atomic<int> pending_{0};
    std::atomic<uint64_t> next_{0}, job_{0};
};

// The one pool of the library (every kernel file shares it; never destroyed, so its threads outlive
// static destructors)
inline ThreadPool& shared_pool() {
    static ThreadPool* pool = new ThreadPool;
    return *pool;
}
