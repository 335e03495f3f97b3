// io_uring backend through the raw kernel interface (io_uring_setup / io_uring_enter and the three
// mmapped regions), so the build needs no liburing. One submitter thread owns the ring: it keeps up
// to `queue_depth` blocks in flight, reaps completions and resubmits the rest of short transfers.
#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <system_error>

#include "aio_engine.h"

namespace tierwise {

namespace {

int sys_io_uring_setup(unsigned entries, io_uring_params* params) {
  return int(::syscall(__NR_io_uring_setup, entries, params));
}

int sys_io_uring_enter(int ring_fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
  return int(::syscall(__NR_io_uring_enter, ring_fd, to_submit, min_complete, flags, nullptr, 0));
}

class Ring {
 public:
  explicit Ring(unsigned entries) {
    io_uring_params params;
    std::memset(&params, 0, sizeof(params));
    fd_ = sys_io_uring_setup(entries, &params);
    if (fd_ < 0) throw std::system_error(errno, std::generic_category(), "io_uring_setup");
    sq_ring_bytes_ = params.sq_off.array + params.sq_entries * sizeof(unsigned);
    cq_ring_bytes_ = params.cq_off.cqes + params.cq_entries * sizeof(io_uring_cqe);
    const bool single_mmap = (params.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single_mmap) sq_ring_bytes_ = cq_ring_bytes_ = std::max(sq_ring_bytes_, cq_ring_bytes_);
    sq_ring_ = map(sq_ring_bytes_, IORING_OFF_SQ_RING);
    cq_ring_ = single_mmap ? sq_ring_ : map(cq_ring_bytes_, IORING_OFF_CQ_RING);
    sqes_bytes_ = params.sq_entries * sizeof(io_uring_sqe);
    sqes_ = static_cast<io_uring_sqe*>(map(sqes_bytes_, IORING_OFF_SQES));

    char* sq = static_cast<char*>(sq_ring_);
    sq_tail_ = reinterpret_cast<unsigned*>(sq + params.sq_off.tail);
    sq_mask_ = *reinterpret_cast<unsigned*>(sq + params.sq_off.ring_mask);
    sq_array_ = reinterpret_cast<unsigned*>(sq + params.sq_off.array);
    char* cq = static_cast<char*>(cq_ring_);
    cq_head_ = reinterpret_cast<unsigned*>(cq + params.cq_off.head);
    cq_tail_ = reinterpret_cast<unsigned*>(cq + params.cq_off.tail);
    cq_mask_ = *reinterpret_cast<unsigned*>(cq + params.cq_off.ring_mask);
    cqes_ = reinterpret_cast<io_uring_cqe*>(cq + params.cq_off.cqes);
    sq_entries_ = params.sq_entries;
  }

  ~Ring() { release(); }

  void release() {
    if (sqes_ != nullptr) ::munmap(sqes_, sqes_bytes_);
    if (cq_ring_ != nullptr && cq_ring_ != sq_ring_) ::munmap(cq_ring_, cq_ring_bytes_);
    if (sq_ring_ != nullptr) ::munmap(sq_ring_, sq_ring_bytes_);
    if (fd_ >= 0) ::close(fd_);
    sqes_ = nullptr;
    sq_ring_ = cq_ring_ = nullptr;
    fd_ = -1;
  }

  unsigned capacity() const { return sq_entries_; }

  // Fill the next submission entry; the kernel sees it after `enter`.
  void push(const Block* block) {
    const unsigned tail = *sq_tail_;  // only this thread writes the tail
    const unsigned index = tail & sq_mask_;
    io_uring_sqe* sqe = &sqes_[index];
    std::memset(sqe, 0, sizeof(*sqe));
    sqe->opcode = block->request->is_read ? IORING_OP_READ : IORING_OP_WRITE;
    sqe->fd = block->fd;
    sqe->off = uint64_t(block->offset) + block->moved;
    sqe->addr = reinterpret_cast<uint64_t>(block->buffer + block->moved);
    sqe->len = unsigned(block->nbytes - block->moved);
    sqe->user_data = reinterpret_cast<uint64_t>(block);
    sq_array_[index] = index;
    __atomic_store_n(sq_tail_, tail + 1, __ATOMIC_RELEASE);
  }

  // Submit `to_submit` entries and wait for at least `min_complete` completions.
  // Returns the number submitted, or -errno.
  int enter(unsigned to_submit, unsigned min_complete) {
    int result = sys_io_uring_enter(fd_, to_submit, min_complete, min_complete ? IORING_ENTER_GETEVENTS : 0);
    return result < 0 ? -errno : result;
  }

  template <typename F>
  unsigned reap(F&& on_completion) {
    unsigned head = *cq_head_;
    const unsigned tail = __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE);
    unsigned count = 0;
    for (; head != tail; ++head, ++count) {
      const io_uring_cqe& cqe = cqes_[head & cq_mask_];
      on_completion(reinterpret_cast<Block*>(cqe.user_data), cqe.res);
    }
    __atomic_store_n(cq_head_, head, __ATOMIC_RELEASE);
    return count;
  }

 private:
  void* map(size_t bytes, off_t offset) {
    void* address = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, offset);
    if (address == MAP_FAILED) {
      int error = errno;
      release();
      throw std::system_error(error, std::generic_category(), "io_uring mmap");
    }
    return address;
  }

  int fd_ = -1;
  void* sq_ring_ = nullptr;
  void* cq_ring_ = nullptr;
  io_uring_sqe* sqes_ = nullptr;
  size_t sq_ring_bytes_ = 0, cq_ring_bytes_ = 0, sqes_bytes_ = 0;
  unsigned* sq_tail_ = nullptr;
  unsigned* sq_array_ = nullptr;
  unsigned sq_mask_ = 0, sq_entries_ = 0;
  unsigned* cq_head_ = nullptr;
  unsigned* cq_tail_ = nullptr;
  unsigned cq_mask_ = 0;
  io_uring_cqe* cqes_ = nullptr;
};

}  // namespace

class UringBackend final : public Backend {
 public:
  explicit UringBackend(Engine& engine) : engine_(engine), ring_(engine.queue_depth()) {
    depth_ = std::min<size_t>(engine.queue_depth(), ring_.capacity());
    thread_ = std::thread([this] { run(); });
  }
  ~UringBackend() override { thread_.join(); }
  const char* name() const override { return "io_uring"; }

 private:
  void run() {
    // Blocks live here (stable addresses are the ring's user_data) from submission to completion.
    std::vector<std::unique_ptr<Block>> retry;
    std::vector<Block> fresh;
    size_t in_flight = 0;
    unsigned unsubmitted = 0;
    bool more = true;
    while (more || in_flight > 0 || !retry.empty()) {
      fresh.clear();
      size_t room = depth_ - in_flight - unsubmitted;
      size_t resubmit = std::min(room, retry.size());
      room -= resubmit;
      if (room > 0 && more) {
        const bool idle = in_flight == 0 && unsubmitted == 0 && retry.empty();
        more = engine_.take(fresh, room, /*block=*/idle);
      }
      for (size_t i = 0; i < resubmit; ++i) {
        ring_.push(retry.back().release());
        retry.pop_back();
      }
      for (auto& block : fresh) ring_.push(new Block(std::move(block)));
      unsubmitted += unsigned(resubmit + fresh.size());
      if (unsubmitted == 0 && in_flight == 0) continue;

      const unsigned wait_for = (in_flight + unsubmitted) > 0 ? 1 : 0;
      int submitted = ring_.enter(unsubmitted, wait_for);
      if (submitted < 0) {
        if (submitted != -EINTR && submitted != -EAGAIN && submitted != -EBUSY) fail_all(-submitted);
        submitted = 0;
      }
      unsubmitted -= unsigned(submitted);
      in_flight += size_t(submitted);
      in_flight -= ring_.reap([&](Block* raw, int result) {
        std::unique_ptr<Block> block(raw);
        if (result == -EINTR || result == -EAGAIN) {
          retry.push_back(std::move(block));
        } else if (result < 0) {
          engine_.complete(*block, -result);
        } else if (result == 0 && block->moved < block->nbytes) {
          engine_.complete(*block, block->request->is_read ? ENODATA : EIO);
        } else {
          block->moved += size_t(result);
          if (block->moved < block->nbytes && short_direct_read(*block)) {
            engine_.complete(*block, ENODATA);
          } else if (block->moved < block->nbytes) {
            retry.push_back(std::move(block));  // short transfer: resubmit the rest
          } else {
            engine_.complete(*block, 0);
          }
        }
      });
    }
  }

  // The ring itself failed (not one request): nothing can be in flight safely, so abort the process
  // rather than leave buffers the kernel may still write into.
  [[noreturn]] static void fail_all(int error_number) {
    std::fprintf(stderr, "tierwise aio: io_uring_enter failed: %s\n", std::strerror(error_number));
    std::abort();
  }

  Engine& engine_;
  Ring ring_;
  size_t depth_ = 0;
  std::thread thread_;
};

std::unique_ptr<Backend> make_uring_backend(Engine& engine) { return std::make_unique<UringBackend>(engine); }

bool io_uring_available(std::string* why) {
  try {
    Ring ring(2);
    return true;
  } catch (const std::system_error& error) {
    if (why != nullptr) *why = error.what();
    return false;
  }
}

}  // namespace tierwise
