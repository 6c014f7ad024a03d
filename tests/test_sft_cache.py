"""The cache of warm-start base policies is shared safely: processes (or threads) that need the same base policy
wait for the one creating it instead of training it again into the same directory."""
import threading
import time

from jaxrl_batch.train import sft


def test_a_second_user_of_a_base_policy_waits_for_the_one_creating_it(tmp_path):
  directory, events = str(tmp_path / "cache" / "key"), []
  entered = threading.Event()

  def first():
    with sft._one_trainer(directory):
      entered.set()
      time.sleep(0.5)
      events.append("first done")

  thread = threading.Thread(target=first)
  thread.start()
  entered.wait()
  with sft._one_trainer(directory):
    events.append("second in")
  thread.join()
  assert events == ["first done", "second in"]
