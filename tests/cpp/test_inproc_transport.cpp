// The in-process transport itself: matching per (src, dst, tag) in posting order, size mismatch and
// timeout errors of kind kBackend, abandon(), and random delivery delays.
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "check.h"
#include "core/error.h"
#include "support/inproc_transport.h"

using namespace rr;

namespace {

InprocOptions quick(int timeout_ms, int64_t delay_us = 0) {
  InprocOptions o;
  o.timeout = std::chrono::milliseconds(timeout_ms);
  o.max_delay_us = delay_us;
  o.seed = 3;
  return o;
}

template <typename F>
ErrorKind kindOf(F&& f, std::string* what = nullptr) {
  try {
    f();
  } catch (const Error& e) {
    if (what) *what = e.what();
    return e.kind();
  }
  return static_cast<ErrorKind>(-1);
}

}  // namespace

TEST_CASE(matches_in_posting_order_per_tag) {
  auto hub = std::make_shared<InprocHub>(2, quick(5000, 50));
  InprocTransport t0(hub, 0), t1(hub, 1);
  int a = 1, b = 2, c = 3;
  int ra = 0, rb = 0, rc = 0;
  // Receives posted in a different tag order than the sends; same-tag messages keep their order.
  const int64_t q1 = t1.irecv(&rc, sizeof rc, 0, 9);
  const int64_t q2 = t1.irecv(&ra, sizeof ra, 0, 5);
  const int64_t q3 = t1.irecv(&rb, sizeof rb, 0, 5);
  const int64_t s1 = t0.isend(&a, sizeof a, 1, 5);
  const int64_t s2 = t0.isend(&b, sizeof b, 1, 5);
  const int64_t s3 = t0.isend(&c, sizeof c, 1, 9);
  t1.wait(q1);
  t1.wait(q2);
  t1.wait(q3);
  t0.wait(s1);
  t0.wait(s2);
  t0.wait(s3);
  t0.wait(s3);  // waiting twice is allowed
  CHECK_EQ(ra, 1);
  CHECK_EQ(rb, 2);
  CHECK_EQ(rc, 3);
}

TEST_CASE(many_threads_with_random_delays) {
  const int n = 4, msgs = 200;
  auto hub = std::make_shared<InprocHub>(n, quick(10000, 100));
  std::vector<std::thread> threads;
  std::vector<int> bad(n, 0);
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      InprocTransport t(hub, r);
      std::vector<int64_t> out(msgs), in(msgs, -1);
      std::vector<int64_t> reqs;
      for (int k = 0; k < msgs; ++k) {
        out[k] = r * 100000 + k;
        reqs.push_back(t.irecv(&in[k], sizeof(int64_t), (r + n - 1) % n, 1));
        reqs.push_back(t.isend(&out[k], sizeof(int64_t), (r + 1) % n, 1));
      }
      for (int64_t q : reqs) t.wait(q);
      for (int k = 0; k < msgs; ++k)
        if (in[k] != ((r + n - 1) % n) * 100000 + k) ++bad[r];
    });
  }
  for (auto& th : threads) th.join();
  for (int r = 0; r < n; ++r) CHECK_EQ(bad[r], 0);
}

TEST_CASE(size_mismatch_is_a_backend_error_on_both_sides) {
  auto hub = std::make_shared<InprocHub>(2, quick(2000));
  InprocTransport t0(hub, 0), t1(hub, 1);
  char buf[16] = {0};
  const int64_t s = t0.isend(buf, 8, 1, 0);
  const int64_t r = t1.irecv(buf + 8, 4, 0, 0);
  std::string what;
  CHECK(kindOf([&] { t0.wait(s); }, &what) == ErrorKind::kBackend);
  CHECK_MSG(what.find("size mismatch") != std::string::npos, what);
  CHECK(kindOf([&] { t1.wait(r); }) == ErrorKind::kBackend);
}

TEST_CASE(timeout_is_a_backend_error) {
  auto hub = std::make_shared<InprocHub>(2, quick(150));
  InprocTransport t0(hub, 0);
  int x = 0;
  const int64_t r = t0.irecv(&x, sizeof x, 1, 0);
  const auto t_start = std::chrono::steady_clock::now();
  std::string what;
  CHECK(kindOf([&] { t0.wait(r); }, &what) == ErrorKind::kBackend);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  CHECK_MSG(s >= 0.14 && s < 5.0, s);
  CHECK_MSG(what.find("timed out") != std::string::npos, what);
}

TEST_CASE(abandon_forgets_requests_and_never_delivers_late) {
  auto hub = std::make_shared<InprocHub>(2, quick(200));
  InprocTransport t0(hub, 0), t1(hub, 1);
  int late = 0, payload = 42;
  const int64_t r = t1.irecv(&late, sizeof late, 0, 0);
  t1.abandon();
  CHECK(kindOf([&] { t1.wait(r); }) == ErrorKind::kBackend);  // forgotten
  const int64_t s = t0.isend(&payload, sizeof payload, 1, 0);
  CHECK(kindOf([&] { t0.wait(s); }) == ErrorKind::kBackend);  // nobody receives: timeout
  CHECK_EQ(late, 0);
  // The hub stays usable for fresh requests.
  int got = 0;
  const int64_t r2 = t1.irecv(&got, sizeof got, 0, 1);
  const int64_t s2 = t0.isend(&payload, sizeof payload, 1, 1);
  t0.wait(s2);
  t1.wait(r2);
  CHECK_EQ(got, 42);
}

TEST_CASE(bad_arguments) {
  CHECK(kindOf([] { InprocHub h(0, InprocOptions{}); }) == ErrorKind::kValue);
  auto hub = std::make_shared<InprocHub>(2, quick(100));
  CHECK(kindOf([&] { InprocTransport t(hub, 2); }) == ErrorKind::kValue);
  InprocTransport t(hub, 0);
  int x = 0;
  CHECK(kindOf([&] { t.isend(&x, sizeof x, 5, 0); }) == ErrorKind::kValue);
  CHECK(kindOf([&] { t.wait(12345); }) == ErrorKind::kBackend);
}

TEST_MAIN()
