// Request bookkeeping shared by both backends; see [Note: request splitting and direct I/O].
#include "aio_engine.h"

#include <algorithm>
#include <cerrno>
#include <stdexcept>
#include <system_error>

namespace tierwise {

namespace {
int64_t round_up(int64_t value, int64_t alignment) { return (value + alignment - 1) / alignment * alignment; }
int64_t round_down(int64_t value, int64_t alignment) { return value / alignment * alignment; }
}  // namespace

Engine::Engine(size_t block_size, unsigned queue_depth, unsigned num_threads, const std::string& backend)
    : block_size_(block_size), queue_depth_(queue_depth), num_threads_(num_threads) {
  if (block_size == 0 || block_size % kDirectAlignment != 0 || block_size > (size_t(1) << 30)) {
    throw std::invalid_argument("block_size must be a positive multiple of 4096 bytes up to 1 GiB, got " +
                                std::to_string(block_size));
  }
  if (queue_depth == 0 || queue_depth > 4096) {
    throw std::invalid_argument("queue_depth must be between 1 and 4096, got " + std::to_string(queue_depth));
  }
  if (num_threads == 0 || num_threads > 256) {
    throw std::invalid_argument("num_threads must be between 1 and 256, got " + std::to_string(num_threads));
  }
  if (backend == "io_uring") {
    backend_ = make_uring_backend(*this);
  } else if (backend == "threads") {
    backend_ = make_thread_backend(*this);
  } else if (backend == "auto") {
    try {
      backend_ = make_uring_backend(*this);
    } catch (const std::system_error&) {
      backend_ = make_thread_backend(*this);
    }
  } else {
    throw std::invalid_argument("backend must be 'auto', 'io_uring' or 'threads', got '" + backend + "'");
  }
}

Engine::~Engine() {
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    stopping_ = true;
  }
  queue_cv_.notify_all();
  backend_.reset();  // joins its threads once every queued block has completed
}

void Engine::split(const std::shared_ptr<Request>& request, int fd, bool direct, char* buffer, size_t nbytes,
                   int64_t offset, std::vector<Block>& out) const {
  for (size_t start = 0; start < nbytes; start += block_size_) {
    size_t size = std::min(block_size_, nbytes - start);
    out.push_back(Block{request, fd, buffer + start, offset + int64_t(start), size, 0, direct});
  }
}

uint64_t Engine::submit(bool is_read, int fd, int buffered_fd, char* buffer, size_t nbytes, int64_t offset,
                        const std::string& path) {
  if (fd < 0) throw std::invalid_argument("fd must be a valid file descriptor, got " + std::to_string(fd));
  if (offset < 0) throw std::invalid_argument("offset must be >= 0, got " + std::to_string(offset));
  auto request = std::make_shared<Request>();
  request->is_read = is_read;
  request->path = path;

  std::vector<Block> blocks;
  const int64_t align = int64_t(kDirectAlignment);
  const int64_t end = offset + int64_t(nbytes);
  const int64_t body_begin = round_up(offset, align);
  const int64_t body_end = round_down(end, align);
  const bool direct = buffered_fd >= 0 && buffered_fd != fd;
  const bool memory_aligned =
      (reinterpret_cast<uintptr_t>(buffer) + uintptr_t(body_begin - offset)) % kDirectAlignment == 0;
  if (direct && body_end > body_begin && memory_aligned) {
    split(request, buffered_fd, false, buffer, size_t(body_begin - offset), offset, blocks);
    split(request, fd, true, buffer + (body_begin - offset), size_t(body_end - body_begin), body_begin, blocks);
    split(request, buffered_fd, false, buffer + (body_end - offset), size_t(end - body_end), body_end, blocks);
  } else {
    split(request, direct ? buffered_fd : fd, false, buffer, nbytes, offset, blocks);
  }
  request->pending_blocks.store(blocks.size());

  uint64_t id;
  {
    std::lock_guard<std::mutex> lock(done_mutex_);
    id = next_id_++;
    request->id = id;
    request->done = blocks.empty();
    requests_.emplace(id, request);
  }
  if (!blocks.empty()) {
    {
      std::lock_guard<std::mutex> lock(queue_mutex_);
      for (auto& block : blocks) queue_.push_back(std::move(block));
    }
    queue_cv_.notify_all();
  }
  return id;
}

bool Engine::take(std::vector<Block>& out, size_t max_blocks, bool block) {
  std::unique_lock<std::mutex> lock(queue_mutex_);
  if (block) queue_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
  while (out.size() < max_blocks && !queue_.empty()) {
    out.push_back(std::move(queue_.front()));
    queue_.pop_front();
  }
  return !(stopping_ && queue_.empty());
}

void Engine::complete(Block& block, int error_number) {
  Request& request = *block.request;
  if (error_number != 0) {
    std::lock_guard<std::mutex> lock(request.error_mutex);
    // Report the failure nearest the start of the request, whichever block finished first.
    const int64_t offset = block.offset + int64_t(block.moved);
    if (!request.failed || offset < request.error.offset) {
      request.failed = true;
      request.error = IoError{error_number, request.is_read, request.path, offset, block.nbytes - block.moved};
    }
  }
  if (request.pending_blocks.fetch_sub(1) == 1) {
    {
      std::lock_guard<std::mutex> lock(done_mutex_);
      request.done = true;
    }
    done_cv_.notify_all();
  }
}

bool Engine::wait(uint64_t id, IoError* error) {
  std::shared_ptr<Request> request;
  {
    std::unique_lock<std::mutex> lock(done_mutex_);
    auto it = requests_.find(id);
    if (it == requests_.end()) {
      throw std::invalid_argument("unknown request " + std::to_string(id) + " (never submitted or already waited)");
    }
    request = it->second;
    done_cv_.wait(lock, [&] { return request->done; });
    requests_.erase(it);
  }
  std::lock_guard<std::mutex> lock(request->error_mutex);
  if (request->failed && error != nullptr) *error = request->error;
  return request->failed;
}

bool Engine::is_done(uint64_t id) {
  std::lock_guard<std::mutex> lock(done_mutex_);
  auto it = requests_.find(id);
  if (it == requests_.end()) {
    throw std::invalid_argument("unknown request " + std::to_string(id) + " (never submitted or already waited)");
  }
  return it->second->done;
}

bool Engine::known(uint64_t id) {
  std::lock_guard<std::mutex> lock(done_mutex_);
  return requests_.count(id) != 0;
}

void Engine::drain() {
  std::unique_lock<std::mutex> lock(done_mutex_);
  done_cv_.wait(lock, [&] {
    for (auto& entry : requests_) {
      if (!entry.second->done) return false;
    }
    return true;
  });
}

}  // namespace tierwise
