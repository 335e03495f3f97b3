// Python binding: one class, `AioHandle`, with submit_read / submit_write / wait (docs/conventions.md).
// Buffers arrive through the buffer protocol; each stays exported (so it can neither be freed nor
// resized) until its request has been waited for. Failures become OSError(errno, message, path)
// carrying `offset` and `nbytes`, the same exception the pure-Python engine raises.
#include <pybind11/pybind11.h>

#include <cstring>
#include <string>
#include <unordered_map>

#include "aio_engine.h"

namespace py = pybind11;

namespace tierwise {
namespace {

struct BufferDeleter {
  void operator()(Py_buffer* view) const {
    PyBuffer_Release(view);
    delete view;
  }
};
using BufferView = std::unique_ptr<Py_buffer, BufferDeleter>;

BufferView export_buffer(const py::object& buffer, bool writable) {
  auto view = std::make_unique<Py_buffer>();
  int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
  if (PyObject_GetBuffer(buffer.ptr(), view.get(), flags) != 0) throw py::error_already_set();
  return BufferView(view.release());
}

[[noreturn]] void raise_io_error(const IoError& error) {
  std::string message = std::string(std::strerror(error.error_number)) + " (" + (error.is_read ? "read" : "write") +
                        " of " + std::to_string(error.nbytes) + " bytes at offset " + std::to_string(error.offset) +
                        ")";
  py::object exception = py::reinterpret_borrow<py::object>(PyExc_OSError)(error.error_number, message, error.path);
  exception.attr("offset") = error.offset;
  exception.attr("nbytes") = error.nbytes;
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exception.ptr())), exception.ptr());
  throw py::error_already_set();
}

class AioHandle {
 public:
  AioHandle(size_t block_size, unsigned queue_depth, unsigned num_threads, const std::string& backend)
      : engine_(std::make_unique<Engine>(block_size, queue_depth, num_threads, backend)) {}

  ~AioHandle() {
    py::gil_scoped_release release;
    engine_.reset();  // finishes every queued block before the buffers below are released
  }

  uint64_t submit(bool is_read, const py::object& buffer, int fd, int64_t offset, const std::string& path,
                  int buffered_fd) {
    BufferView view = export_buffer(buffer, /*writable=*/is_read);
    uint64_t id = engine_->submit(is_read, fd, buffered_fd, static_cast<char*>(view->buf), size_t(view->len), offset,
                                  path);
    views_.emplace(id, std::move(view));
    return id;
  }

  void wait(uint64_t id) {
    IoError error;
    bool failed;
    {
      py::gil_scoped_release release;
      failed = engine_->wait(id, &error);
    }
    views_.erase(id);
    if (failed) raise_io_error(error);
  }

  bool done(uint64_t id) { return engine_->is_done(id); }

  const Engine& engine() const { return *engine_; }

 private:
  std::unique_ptr<Engine> engine_;
  std::unordered_map<uint64_t, BufferView> views_;
};

}  // namespace
}  // namespace tierwise

PYBIND11_MODULE(_aio_ext, m) {
  using tierwise::AioHandle;
  m.doc() = "Tierwise async direct I/O engine (io_uring or a pread/pwrite thread pool)";
  m.attr("DIRECT_ALIGNMENT") = tierwise::kDirectAlignment;
  m.def(
      "io_uring_available",
      [] {
        std::string why;
        bool ok = tierwise::io_uring_available(&why);
        return py::make_tuple(ok, why);
      },
      "(available, reason): whether this kernel lets the process create an io_uring.");

  py::class_<AioHandle>(m, "AioHandle")
      .def(py::init<size_t, unsigned, unsigned, const std::string&>(), py::kw_only(), py::arg("block_size"),
           py::arg("queue_depth"), py::arg("num_threads"), py::arg("backend") = "auto")
      .def(
          "submit_read",
          [](AioHandle& self, const py::object& buffer, int fd, int64_t offset, const std::string& path,
             int buffered_fd) { return self.submit(true, buffer, fd, offset, path, buffered_fd); },
          py::kw_only(), py::arg("buffer"), py::arg("fd"), py::arg("offset"), py::arg("path"),
          py::arg("buffered_fd") = -1,
          "Queue a read of len(buffer) bytes at `offset` into `buffer` (writable, C-contiguous); returns its id.")
      .def(
          "submit_write",
          [](AioHandle& self, const py::object& buffer, int fd, int64_t offset, const std::string& path,
             int buffered_fd) { return self.submit(false, buffer, fd, offset, path, buffered_fd); },
          py::kw_only(), py::arg("buffer"), py::arg("fd"), py::arg("offset"), py::arg("path"),
          py::arg("buffered_fd") = -1, "Queue a write of `buffer` at `offset`; returns its id.")
      .def("wait", &AioHandle::wait, py::arg("request"),
           "Block (without the GIL) until the request finished; raise OSError if it failed.")
      .def("done", &AioHandle::done, py::arg("request"), "Whether the request has finished (wait still required).")
      .def_property_readonly("backend", [](const AioHandle& self) { return self.engine().backend_name(); })
      .def_property_readonly("block_size", [](const AioHandle& self) { return self.engine().block_size(); })
      .def_property_readonly("queue_depth", [](const AioHandle& self) { return self.engine().queue_depth(); })
      .def_property_readonly("num_threads", [](const AioHandle& self) { return self.engine().num_threads(); });
}
