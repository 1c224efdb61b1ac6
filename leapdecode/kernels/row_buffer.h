// A growable buffer whose new elements are left unwritten, for scratch that the kernels fill before they read it
// (std::vector's resize zeroes every new element first).
#pragma once
#include <memory>
#include <new>
#include <vector>

// std::allocator, except that a value-initialised element is left unwritten: the users write every element before
// reading it (zeroing quantize_rows' codes first was 0.6% of a 16-row int8 step's samples)
template <class T>
struct UninitAllocator : std::allocator<T> {
  template <class U>
  struct rebind {
    using other = UninitAllocator<U>;
  };
  UninitAllocator() = default;
  template <class U>
  UninitAllocator(const UninitAllocator<U>&) noexcept {}
  template <class U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
};
template <class T>
using RowBuffer = std::vector<T, UninitAllocator<T>>;
