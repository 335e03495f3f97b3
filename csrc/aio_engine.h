// Tierwise async I/O engine: large reads/writes split into blocks and kept in flight in parallel.
//
// [Note: request splitting and direct I/O]
// A request (buffer, file offset, size) is cut into pieces. On a file opened with O_DIRECT the
// 4 KiB-aligned middle goes through the direct fd in `block_size` blocks; an unaligned head or tail
// (or a whole request whose memory is not 4 KiB-aligned) goes through a second, buffered fd of the
// same file. Linux keeps the two coherent (a direct read first writes back dirty cached pages of its
// range; a direct write invalidates them), so callers may mix aligned and unaligned requests freely
// as long as concurrent requests do not overlap. Swap-store traffic is always aligned and therefore
// never touches the page cache.
//
// Two backends drain the same block queue: io_uring through the raw kernel interface (one submitter
// thread keeps up to `queue_depth` blocks in flight) and a pool of `num_threads` pread/pwrite
// threads (where io_uring is unavailable, or when chosen). Neither needs torch or CUDA.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace tierwise {

constexpr size_t kDirectAlignment = 4096;

// The failure of a request nearest its start (deterministic however blocks race), reported to Python.
struct IoError {
  int error_number = 0;    // errno; ENODATA for a read that ran past the end of the file
  bool is_read = false;
  std::string path;
  int64_t offset = 0;      // file offset of the failed piece
  size_t nbytes = 0;       // bytes that piece still had to move
};

struct Request {
  uint64_t id = 0;
  bool is_read = false;
  std::string path;
  std::atomic<size_t> pending_blocks{0};
  std::mutex error_mutex;
  bool failed = false;     // guarded by error_mutex
  IoError error;           // guarded by error_mutex
  bool done = false;       // guarded by Engine::done_mutex_
};

struct Block {
  std::shared_ptr<Request> request;
  int fd = -1;
  char* buffer = nullptr;
  int64_t offset = 0;
  size_t nbytes = 0;
  size_t moved = 0;        // bytes already transferred (short reads/writes resume from here)
  bool direct = false;     // `fd` is the O_DIRECT descriptor
};

// A direct read that stopped short at an unaligned position hit the end of the file: resuming there
// would fail with EINVAL instead of reporting the end of file.
inline bool short_direct_read(const Block& block) {
  return block.direct && block.request->is_read && (block.offset + int64_t(block.moved)) % 4096 != 0;
}

class Engine;

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
};

// Create the io_uring backend; throws std::system_error when the kernel refuses io_uring.
std::unique_ptr<Backend> make_uring_backend(Engine& engine);
std::unique_ptr<Backend> make_thread_backend(Engine& engine);
bool io_uring_available(std::string* why);

class Engine {
 public:
  // backend: "auto" (io_uring, else threads), "io_uring" or "threads".
  Engine(size_t block_size, unsigned queue_depth, unsigned num_threads, const std::string& backend);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queue one request; returns its id. `buffered_fd` < 0 means `fd` is not direct.
  uint64_t submit(bool is_read, int fd, int buffered_fd, char* buffer, size_t nbytes, int64_t offset,
                  const std::string& path);
  // Block until request `id` finished; returns true and fills `error` if it failed.
  bool wait(uint64_t id, IoError* error);
  bool is_done(uint64_t id);
  bool known(uint64_t id);
  void drain();

  const char* backend_name() const { return backend_->name(); }
  size_t block_size() const { return block_size_; }
  unsigned queue_depth() const { return queue_depth_; }
  unsigned num_threads() const { return num_threads_; }

  // -- used by the backends ------------------------------------------------------------------
  // Pop up to `max_blocks` queued blocks; waits while the queue is empty unless `block` is false.
  // Returns false once the engine stops and the queue is empty.
  bool take(std::vector<Block>& out, size_t max_blocks, bool block);
  void complete(Block& block, int error_number);

 private:
  void split(const std::shared_ptr<Request>& request, int fd, bool direct, char* buffer, size_t nbytes,
             int64_t offset, std::vector<Block>& out) const;

  size_t block_size_;
  unsigned queue_depth_;
  unsigned num_threads_;

  std::mutex queue_mutex_;
  std::condition_variable queue_cv_;
  std::deque<Block> queue_;
  bool stopping_ = false;

  std::mutex done_mutex_;
  std::condition_variable done_cv_;
  std::unordered_map<uint64_t, std::shared_ptr<Request>> requests_;
  uint64_t next_id_ = 1;

  std::unique_ptr<Backend> backend_;  // last: its threads stop before the queues are destroyed
  friend class ThreadBackend;
  friend class UringBackend;
};

}  // namespace tierwise
