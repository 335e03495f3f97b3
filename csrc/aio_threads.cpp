// Thread-pool backend: each of `num_threads` workers moves one block at a time with pread/pwrite.
// The effective queue depth is the thread count.
#include <unistd.h>

#include <cerrno>

#include "aio_engine.h"

namespace tierwise {

class ThreadBackend final : public Backend {
 public:
  explicit ThreadBackend(Engine& engine) : engine_(engine) {
    for (unsigned i = 0; i < engine.num_threads(); ++i) workers_.emplace_back([this] { run(); });
  }
  ~ThreadBackend() override {
    for (auto& worker : workers_) worker.join();
  }
  const char* name() const override { return "threads"; }

 private:
  void run() {
    std::vector<Block> blocks;
    while (true) {
      blocks.clear();
      bool more = engine_.take(blocks, 1, /*block=*/true);
      for (auto& block : blocks) engine_.complete(block, transfer(block));
      if (!more && blocks.empty()) return;
    }
  }

  // Moves the whole block, resuming after short transfers; returns 0 or an errno.
  static int transfer(Block& block) {
    const bool is_read = block.request->is_read;
    while (block.moved < block.nbytes) {
      char* address = block.buffer + block.moved;
      size_t remaining = block.nbytes - block.moved;
      off_t offset = off_t(block.offset + int64_t(block.moved));
      ssize_t result = is_read ? ::pread(block.fd, address, remaining, offset)
                               : ::pwrite(block.fd, address, remaining, offset);
      if (result < 0) {
        if (errno == EINTR) continue;
        return errno;
      }
      if (result == 0) return is_read ? ENODATA : EIO;  // end of file / a write that moved nothing
      block.moved += size_t(result);
      if (block.moved < block.nbytes && short_direct_read(block)) return ENODATA;
    }
    return 0;
  }

  Engine& engine_;
  std::vector<std::thread> workers_;
};

std::unique_ptr<Backend> make_thread_backend(Engine& engine) { return std::make_unique<ThreadBackend>(engine); }

}  // namespace tierwise
